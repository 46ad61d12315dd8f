.PHONY: demo test lint docs clean

demo:  ## live leader election demo (throwaway PostgreSQL unless PG_DSN is set); options: make demo ARGS="..."
	./scripts/demo.sh $(ARGS)

test:  ## install everything into .venv and run lint, types, docs and the whole test suite
	./scripts/test.sh

lint:
	.venv/bin/ruff check src tests benchmarks examples
	.venv/bin/ruff format --check src tests benchmarks examples
	.venv/bin/mypy

docs:
	.venv/bin/mkdocs serve

clean:
	rm -rf .venv site .pytest_cache .mypy_cache .ruff_cache
