"""The torchvision data sets on disk: which files each needs under --data-dir, fetching a missing one, and
reading one as tensors. torch and torchvision are imported only to fetch or read, so the preflight checks and
fetches a data set before torchrun starts; common/data.py reads the sets for the workers.
"""

from __future__ import annotations

import os

from common.errors import UserError


class DataMissingError(UserError, RuntimeError):
    """A torchvision data set is neither on disk nor downloadable."""


# The files torchvision looks for, relative to --data-dir.
EXPECTED_FILES = {
    "mnist": [f"MNIST/raw/{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")],
    "fashion-mnist": [
        f"FashionMNIST/raw/{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")
    ],
    "cifar10": [
        f"cifar-10-batches-py/{f}" for f in ("batches.meta", "test_batch", *(f"data_batch_{i}" for i in range(1, 6)))
    ],
}


def torchvision_dataset(name: str):
    import torchvision  # imported here only: it costs seconds, and the built-in data set does not need it

    return {
        "mnist": torchvision.datasets.MNIST,
        "fashion-mnist": torchvision.datasets.FashionMNIST,
        "cifar10": torchvision.datasets.CIFAR10,
    }[name]


def data_present(name: str, data_dir: str) -> bool:
    return name == "digits" or all(os.path.exists(os.path.join(data_dir, f)) for f in EXPECTED_FILES[name])


def missing_data_message(name: str, data_dir: str, *, reason: str = "") -> str:
    where = os.path.join(data_dir, os.path.dirname(EXPECTED_FILES[name][0]))
    names = ", ".join(os.path.basename(f) for f in EXPECTED_FILES[name])
    because = f" ({reason})" if reason else ""
    return (
        f"--data-dir: {name} is not in {data_dir!r} and could not be downloaded{because}; "
        f"put {names} in {where}/ or run once with network access"
    )


def ensure_data(name: str, data_dir: str) -> None:
    """Download a missing torchvision data set, or raise DataMissingError saying where it belongs."""
    if data_present(name, data_dir):
        return
    dataset_class = torchvision_dataset(name)
    try:
        for train in (True, False):
            dataset_class(root=data_dir, train=train, download=True)
    except Exception as e:  # offline: URLError / OSError / RuntimeError from torchvision
        raise DataMissingError(missing_data_message(name, data_dir, reason=last_line(e))) from None


def last_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else type(error).__name__


def read_split(name: str, data_dir: str, *, train: bool, download: bool):
    """(uint8 images [N, C, H, W], int64 labels [N]) of the train or test split of a torchvision data set."""
    import torch

    try:
        ds = torchvision_dataset(name)(root=data_dir, train=train, download=download)
    except Exception as e:  # torchvision raises RuntimeError when absent, URLError/OSError when offline
        raise DataMissingError(missing_data_message(name, data_dir, reason=last_line(e) if download else "")) from None
    images = torch.as_tensor(ds.data)
    images = images.unsqueeze(1) if images.ndim == 3 else images.permute(0, 3, 1, 2)  # -> [N, C, H, W]
    return images.contiguous(), torch.as_tensor(ds.targets, dtype=torch.int64)
