"""Package discovery for the one import namespace ``hdp`` built from four source roots.

``hdp/`` is ``hdp``, ``packing/`` is ``hdp.packing``, ``trainer/`` is ``hdp.trainer`` and
``integrations/`` is ``hdp.integrations``.  Every folder with an ``__init__.py`` under a root is a
package (``find_packages``), so no hand-kept list can forget one (the wheel once shipped without
``hdp.packing.policies.hdp``).  Metadata, dependencies and package data live in pyproject.toml.
"""

from setuptools import find_packages, setup

ROOTS = {"hdp": "hdp", "hdp.packing": "packing", "hdp.trainer": "trainer", "hdp.integrations": "integrations"}

packages: list[str] = []
package_dir: dict[str, str] = {}
for name, path in ROOTS.items():
    package_dir[name] = path
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(path)]

setup(packages=packages, package_dir=package_dir)
