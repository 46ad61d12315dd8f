.PHONY: demo test lint docs docs-check clean

demo:  ## live leader election demo (throwaway PostgreSQL unless PG_DSN is set); options: make demo ARGS="..."
	./scripts/demo.sh $(ARGS)

test:  ## install everything into .venv and run lint, types, docs and the whole test suite
	./scripts/test.sh

lint:  ## ruff and mypy --strict (installs into .venv first)
	./scripts/install.sh
	.venv/bin/ruff check src tests benchmarks examples
	.venv/bin/ruff format --check src tests benchmarks examples
	.venv/bin/mypy

docs:  ## serve the docs locally (installs into .venv first)
	./scripts/install.sh
	.venv/bin/mkdocs serve

docs-check:  ## build the docs strictly: any warning (a broken cross-reference, a missing page) fails
	./scripts/install.sh
	./scripts/docs_check.sh

clean:
	rm -rf .venv site .pytest_cache .mypy_cache .ruff_cache
