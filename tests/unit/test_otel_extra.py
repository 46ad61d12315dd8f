"""The OpenTelemetry plugin is an extra: without ``opentelemetry`` its import names the
extra to install, and neither ``pgleaderlock`` nor ``pgleaderlock.health`` needs it."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_without_opentelemetry_the_plugin_names_its_extra_and_health_still_imports() -> None:
    body = """
        import sys
        sys.modules["opentelemetry"] = None
        import pgleaderlock
        import pgleaderlock.health
        try:
            import pgleaderlock.plugins.otel
        except ImportError as exc:
            assert "pip install 'pgleaderlock[otel]'" in str(exc), exc
        else:
            raise AssertionError("imported without opentelemetry")
        assert "opentelemetry" not in {m.split(".")[0] for m in sys.modules if sys.modules[m]}
    """
    subprocess.run([sys.executable, "-c", textwrap.dedent(body)], check=True, timeout=50)
