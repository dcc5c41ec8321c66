"""tfpipe: pipelined model-parallel training of Keras models on TensorFlow."""

import setuptools

# TensorFlow comes with an extra, because its CPU and GPU builds are different distributions
# to pip: `pip install -e ".[cpu]"` (tensorflow-cpu) or `pip install -e ".[gpu]"` (tensorflow,
# with NVIDIA's CUDA libraries from pip). `profile` adds TensorBoard's Profile tab.

setuptools.setup(
    name="tfpipe",
    version="0.1.0",
    description="Pipelined model parallelism for Keras on TensorFlow: SpecTrain, PipeDream, "
                "vanilla pipelining and data-parallel baselines",
    packages=setuptools.find_packages(include=["tfpipe", "tfpipe.*", "trainers", "trainers.*"]),
    package_data={"tfpipe.cluster": ["bind_host.c"]},   # the TF servers' bind shim (tfpipe.cluster.bind)
    python_requires=">=3.9",
    install_requires=[
        "keras>=3",
        "absl-py",
        "tensorboard",
        "tensorflow-datasets",
        "scikit-learn",
        "numpy",
        "matplotlib",  # prediction-error plots, learning curves
        # Emulated hosts (tfpipe.cluster.emulation): network namespaces, links, over netlink.
        "pyroute2>=0.7; sys_platform == 'linux'",
    ],
    extras_require={
        "cpu": ["tensorflow-cpu>=2.16"],
        "gpu": ["tensorflow[and-cuda]>=2.16"],
        "profile": ["tensorboard-plugin-profile"],
        # Tests run on two workers (-n 2) with --dist loadgroup. pytest 9 keeps a test's id
        # where pytest-xdist (3.8) can no longer tag it with its xdist_group, so groups were
        # spread over the workers: pytest < 9 until pytest-xdist follows.
        # The documentation site (mkdocs.yml): `mkdocs serve`. The tests build it strictly.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"],
        "test": ["pytest>=8,<9", "pytest-xdist>=3.5", "mkdocs>=1.6", "mkdocs-material>=9.5",
                 "mkdocstrings[python]>=0.26", "mypy>=1.10"],
    },
    entry_points={"console_scripts": ["tfpipe-train=trainers.main:entry"]},
)
