"""adaptdl._plugins: the one way --plugin modules are imported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from adaptdl._plugins import PluginImportError, import_plugins

_NAMES = ("plugin_ok", "plugin_raises", "plugin_exits")


@pytest.fixture
def plugin_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setattr(sys, "path", list(sys.path))
    (tmp_path / "plugin_ok.py").write_text("LOADED = True\n")
    (tmp_path / "plugin_raises.py").write_text("raise ValueError('needs a license file')\n")
    (tmp_path / "plugin_exits.py").write_text("import sys\nsys.exit(3)\n")
    yield tmp_path
    for name in _NAMES:  # imported from a directory that is about to go
        sys.modules.pop(name, None)


def test_imports_from_the_search_dir_appended_last(plugin_dir: Path) -> None:
    import_plugins(["plugin_ok"], str(plugin_dir))
    assert sys.modules["plugin_ok"].LOADED is True
    assert sys.path[-1] == str(plugin_dir)
    import_plugins(["plugin_ok"], str(plugin_dir))  # not appended twice
    assert sys.path.count(str(plugin_dir)) == 1


def test_no_modules_leave_sys_path_alone(plugin_dir: Path) -> None:
    before = list(sys.path)
    import_plugins([], str(plugin_dir))
    assert sys.path == before


@pytest.mark.parametrize(
    ("module", "reason"),
    [
        ("no_such_plugin_module", "ModuleNotFoundError: No module named 'no_such_plugin_module'"),
        ("plugin_raises", "ValueError: needs a license file"),
        ("plugin_exits", "SystemExit: 3"),
        ("  ", "expected a module name"),
    ],
)
def test_any_failure_names_the_module(plugin_dir: Path, module: str, reason: str) -> None:
    with pytest.raises(PluginImportError) as info:
        import_plugins(["plugin_ok", module], str(plugin_dir))
    assert (info.value.module, info.value.reason) == (module, reason)
    if module == "no_such_plugin_module":  # the plugin itself is missing: say where to put it
        assert info.value.searched == str(plugin_dir)
        assert str(info.value) == (
            f"--plugin {module!r} cannot be imported: {reason} "
            f"(looked in the installed packages, then in {plugin_dir})"
        )
    elif module.strip():
        assert info.value.searched is None
        assert str(info.value) == f"--plugin {module!r} cannot be imported: {reason}"
    else:
        assert str(info.value) == f"--plugin {module!r}: {reason}"
    assert isinstance(info.value, ImportError)
    # A blank name is a usage error (exit 2); a module that fails is not.
    assert info.value.exit_code == (1 if module.strip() else 2)


def test_a_file_path_is_a_usage_error(plugin_dir: Path) -> None:
    with pytest.raises(PluginImportError, match="not a file path") as info:
        import_plugins(["./plugin_ok.py"], str(plugin_dir))
    assert info.value.exit_code == 2


def test_a_module_the_plugin_imports_gets_no_search_hint(plugin_dir: Path) -> None:
    (plugin_dir / "plugin_needs.py").write_text("import no_such_dependency_module\n")
    try:
        with pytest.raises(PluginImportError) as info:
            import_plugins(["plugin_needs"], str(plugin_dir))
    finally:
        sys.modules.pop("plugin_needs", None)
    assert info.value.searched is None
    assert "no_such_dependency_module" in str(info.value) and "looked in" not in str(info.value)


def test_a_missing_plugin_without_a_search_dir_gets_no_hint() -> None:
    with pytest.raises(PluginImportError) as info:
        import_plugins(["no_such_plugin_module"])
    assert info.value.searched is None and "looked in" not in str(info.value)


@pytest.mark.parametrize("given", ["./plugin_ok.py", "sub/plugin_ok", "plugin_ok.py", "nope.py"])
def test_a_file_name_is_answered_with_the_module_name(plugin_dir: Path, given: str) -> None:
    # importlib's own answers ("the 'package' argument is required ..." or
    # "'plugin_ok' is not a package") did not say what to pass instead.
    with pytest.raises(PluginImportError) as info:
        import_plugins([given], str(plugin_dir))
    stem = given.rsplit("/", 1)[-1].removesuffix(".py")
    assert f"use --plugin {stem} (from its directory" in str(info.value)


@pytest.mark.parametrize(("name", "where"), [("random", "at "), ("sys", "built into Python")])
def test_a_plugin_file_hidden_by_another_module_is_refused(
    plugin_dir: Path, name: str, where: str
) -> None:
    # Before: the standard library's module was imported in its place, its
    # policies never registered, and only "unknown policy" was said.
    (plugin_dir / f"{name}.py").write_text("raise AssertionError('never imported')\n")
    with pytest.raises(PluginImportError) as info:
        import_plugins([name], str(plugin_dir))
    assert info.value.module == name
    assert str(info.value).startswith(
        f"--plugin {name!r} cannot be imported: {plugin_dir / name}.py is hidden by "
        f"the standard-library module {name!r} ({where}"
    )
    assert str(info.value).endswith("; rename your file")


def test_a_hidden_package_is_refused_too(plugin_dir: Path) -> None:
    (plugin_dir / "json").mkdir()
    (plugin_dir / "json" / "__init__.py").write_text("")
    with pytest.raises(
        PluginImportError,
        match=r"json/__init__\.py is hidden by the standard-library module 'json'",
    ):
        import_plugins(["json.decoder"], str(plugin_dir))


def test_a_plugin_found_earlier_on_the_path_is_not_hidden(
    plugin_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On PYTHONPATH (before the search dir) the file itself is imported: fine.
    monkeypatch.syspath_prepend(str(plugin_dir))
    import_plugins(["plugin_ok"], str(plugin_dir))
    assert sys.modules["plugin_ok"].LOADED is True


def test_an_installed_copy_found_first_is_used(
    plugin_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    # As after "pip install ." in the plugin's own source tree.
    site = tmp_path_factory.mktemp("site")
    (site / "plugin_copy.py").write_text("WHERE = 'installed'\n")
    (plugin_dir / "plugin_copy.py").write_text("WHERE = 'search dir'\n")
    sys.path.insert(0, str(site))  # the fixture restores sys.path
    try:
        import_plugins(["plugin_copy"], str(plugin_dir))
        assert sys.modules["plugin_copy"].WHERE == "installed"
    finally:
        sys.modules.pop("plugin_copy", None)
