# kernels/ and patches/ live at the top of the repository (the design's layout) but ship inside
# the tlt_verl namespace, so that they never clash with other top-level `kernels` / `patches`.
from setuptools import find_packages, setup

MAPPED = ("kernels", "patches")
packages = find_packages(include=["tlt_verl", "tlt_verl.*"])
for root in MAPPED:
    packages += [f"tlt_verl.{p}" for p in find_packages(include=[root, f"{root}.*"])]

setup(packages=packages, package_dir={f"tlt_verl.{root}": root for root in MAPPED})
