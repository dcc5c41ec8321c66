"""tfpipe: pipelined model-parallel training of Keras models on TensorFlow."""

import os

import setuptools

# "tensorflow" by default; machines without a GPU may ask for the smaller CPU build with
# TFPIPE_TENSORFLOW="tensorflow-cpu>=2.16" (the two are different distributions to pip).
TENSORFLOW = os.environ.get("TFPIPE_TENSORFLOW", "tensorflow>=2.16")

setuptools.setup(
    name="tfpipe",
    version="0.1.0",
    description="Pipelined model parallelism for Keras on TensorFlow: SpecTrain, PipeDream, "
                "vanilla pipelining and data-parallel baselines",
    packages=setuptools.find_packages(include=["tfpipe", "tfpipe.*", "trainers", "trainers.*"]),
    python_requires=">=3.9",
    install_requires=[
        TENSORFLOW,
        "keras>=3",
        "absl-py",
        "tensorboard",
        "tensorflow-datasets",
        "scikit-learn",
        "numpy",
        "matplotlib",  # prediction-error plots, learning curves
    ],
    extras_require={"test": ["pytest"]},
    entry_points={"console_scripts": ["tfpipe-train=trainers.main:entry"]},
)
