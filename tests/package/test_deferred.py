"""traceana._deferred: a module's code runs on first use, once, and a package runs before its submodules."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

CHECK = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from traceana import _deferred
    ran = []
    sys.modules["ran"] = ran  # the modules below append their name when their code runs
    _deferred.defer("flat", "pkg")
    import flat, pkg
    assert ran == [], ran  # imported (again) but not run
    assert flat.VALUE == 42 and ran == ["flat"], ran
    assert flat.VALUE == 42 and ran == ["flat"], ran  # once
    import pkg.sub
    assert ran == ["flat", "pkg", "pkg.sub"], ran  # the package ran before its submodule, as an eager import
    assert pkg.sub.PARENT == "pkg" and type(pkg).__name__ == "module"
    import json
    before = sys.modules["json"]
    _deferred.defer("json")  # already imported: left alone
    assert sys.modules["json"] is before
    _deferred.defer("no_such_module_here")  # nothing to defer
    assert "no_such_module_here" not in sys.modules
    print("ok")
""")


@pytest.fixture
def modules(tmp_path):
    (tmp_path / "flat.py").write_text("import ran\nran.append('flat')\nVALUE = 42\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import ran\nran.append('pkg')\nNAME = 'pkg'\n")
    (tmp_path / "pkg" / "sub.py").write_text("import ran\nran.append('pkg.sub')\nfrom pkg import NAME as PARENT\n")
    return tmp_path


def test_deferred_module_runs_on_first_use_and_packages_before_submodules(modules):
    out = subprocess.run([sys.executable, "-c", CHECK.format(root=str(modules))], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_failing_module_raises_at_first_use_and_is_retried_by_the_next_import(tmp_path):
    (tmp_path / "bad.py").write_text("raise ValueError('boom')\n")
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from traceana import _deferred
        _deferred.defer("bad")
        import bad
        try:
            bad.anything
        except ValueError as e:
            print(e)
        assert "bad" not in sys.modules  # as a failed import leaves it: the next import runs it again (eagerly)
        try:
            import bad
        except ValueError as e:
            print(e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["boom", "boom"]
