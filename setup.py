"""The three rooms are top-level folders that install as subpackages of `berth`.

setuptools' `package-dir` maps a package to a folder but does not discover the subpackages
under a remapped folder, so they are listed here from the tree itself.
"""

from setuptools import find_packages, setup

ROOMS = {"berth": "berth", "berth.engine": "engine", "berth.kernels": "kernels", "berth.operator": "operator"}

packages = []
for name, folder in ROOMS.items():
    packages.append(name)
    if name != "berth":
        packages += [f"{name}.{sub}" for sub in find_packages(folder)]

setup(
    packages=packages,
    package_dir=ROOMS,
    package_data={
        "berth.operator": ["*.yaml"],
        "berth.engine": ["models/*.txt"],
        "berth.kernels": ["cpu/*.c", "cpu/*.h"],
    },
)
