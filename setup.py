"""What pyproject.toml cannot say: the packages are found, never listed, and two folders of the checkout
travel inside the package as data, so that an installed CloudML (a wheel, Colab's `pip install` of the
Drive copy) reads them without a checkout:

- configs/            -> cloudml_lib/configs    the presets and sweep spaces (`--preset`, `--space`)
- benchmarks/results/ -> cloudml_lib/measured   the figures the library quotes (compile, GPU memory)

cloudml_lib/base/resources.py finds the same files in either layout. cloudml_lib/_source.json exists only in a
Colab install (colab/install.py writes it into its build copy): the Drive copy's fingerprint.
tests/test_packaging.py builds the wheel and compares its contents with the checkout, so a new module or data
file cannot be left out.
"""

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).resolve().parent
MAPPED = {"cloudml_lib.configs": "configs", "cloudml_lib.measured": "benchmarks/results"}
DATA = ("*.yaml", "*.json")


def data_packages() -> dict[str, str]:
    """Each mapped folder and its sub-folders as packages (cloudml_lib.configs.sweeps, ...)."""
    out = {}
    for package, folder in MAPPED.items():
        for d in [HERE / folder, *sorted(p for p in (HERE / folder).rglob("*") if p.is_dir())]:
            if d.name.startswith((".", "__")):
                continue
            rel = d.relative_to(HERE / folder).parts
            out[".".join((package, *rel))] = "/".join((folder, *rel))
    return out


packages = data_packages()
setup(
    packages=find_packages(include=["cloudml_lib", "cloudml_lib.*"]) + list(packages),
    package_dir=packages,
    package_data={"cloudml_lib": ["_source.json"], **{name: list(DATA) for name in packages}},
)
