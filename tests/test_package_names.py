"""The suite's packages (tests/<name>/) are imported by their bare names
(pytest puts tests/ first on sys.path), so one named like an installed
module hides it from everything that imports it: transformers 5.25 began
importing the ``kernels`` package (Hugging Face's hub kernels) and found
tests/kernels instead, failing 900 tests.  That folder is now
tests/native_kernels."""

from importlib.metadata import packages_distributions
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_test_package_is_named_like_an_installed_module():
    installed = packages_distributions()
    packages = sorted(p.parent.name for p in TESTS.glob("*/__init__.py"))
    assert "native_kernels" in packages        # the suite's packages were found
    clashes = {name: installed[name] for name in packages if name in installed}
    assert not clashes, (
        f"test packages named like installed modules (rename the folders): {clashes}")
