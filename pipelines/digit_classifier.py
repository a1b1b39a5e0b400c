"""The 16x16 digits data set and the small CNN that judges every bundled model (`ConvClassifier`).

A classifier judges a bundled diffusion model: `predict` gives the class-accuracy of generated samples and
`features` gives penultimate activations, a stand-in for Inception features in Frechet-distance (FID-style) metrics.

Digit images: float tensors [B, 1, 16, 16] with values in [0, 1] (0 = background).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_SIZE = 16
NUM_CLASSES = 10
_SPLIT_SEED = 0  # fixed stratified 80/20 split; the "test" part is never trained on (classifier or diffusion model)
_TEST_FRACTION = 0.2


def load_digits_16(split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """scikit-learn's `load_digits` (1797 images of 8x8, values 0..16) upsampled to 16x16.

    Returns (images [N, 1, 16, 16] float32 in [0, 1], labels [N] int64). split: "train" (1437), "test" (360) or "all".
    Needs scikit-learn (the `dev` extra); the data ships with it, nothing is downloaded.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}.")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as error:
        raise ImportError("load_digits_16 needs scikit-learn: pip install 'dcache[dev]' or pip install "
                          "scikit-learn.") from error

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [N, 1, 8, 8] in [0, 1]
    images = F.interpolate(images, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    labels = torch.tensor(digits.target, dtype=torch.int64)
    if split == "all":
        return images, labels
    train_idx, test_idx = train_test_split(
        torch.arange(len(labels)).numpy(), test_size=_TEST_FRACTION, random_state=_SPLIT_SEED, stratify=labels.numpy()
    )
    idx = torch.as_tensor(train_idx if split == "train" else test_idx)
    return images[idx], labels[idx]


class ConvClassifier(nn.Module):
    """Two conv stages and an MLP head: inputs [B, *input_shape] -> features [B, feature_dim] -> logits
    [B, num_classes]. input_shape is (C, H, W) for images or (F, C, H, W) for clips, whose frames are stacked as
    channels ([B, F, C, H, W] -> [B, F*C, H, W]: the first conv sees motion across frames). H and W divisible by 4.
    """

    def __init__(self, channels: tuple[int, int] = (32, 64), feature_dim: int = 128, num_classes: int = NUM_CLASSES,
                 input_shape: tuple[int, ...] = (1, IMAGE_SIZE, IMAGE_SIZE)):
        super().__init__()
        self.config = {"channels": list(channels), "feature_dim": feature_dim, "num_classes": num_classes,
                       "input_shape": list(input_shape)}
        c0, c1, c2 = math.prod(input_shape[:-2]), *channels
        height, width = input_shape[-2:]
        self.stage1 = nn.Sequential(  # [B, c0, H, W] -> [B, c1, H/2, W/2]
            nn.Conv2d(c0, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
            nn.Conv2d(c1, c1, 3, padding=1), nn.BatchNorm2d(c1), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.stage2 = nn.Sequential(  # [B, c1, H/2, W/2] -> [B, c2, H/4, W/4]
            nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(),
            nn.Conv2d(c2, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.embed = nn.Sequential(nn.Flatten(), nn.Dropout(0.2),
                                   nn.Linear(c2 * (height // 4) * (width // 4), feature_dim), nn.ReLU())
        self.head = nn.Linear(feature_dim, num_classes)

    def _check(self, images: torch.Tensor) -> None:
        shape = tuple(self.config["input_shape"])
        if tuple(images.shape[1:]) != shape:
            raise ValueError(
                f"{type(self).__name__} expects inputs [B, {', '.join(map(str, shape))}] in [0, 1], got shape "
                f"{tuple(images.shape)}; use the pipeline's output_type='pt'."
            )

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, *input_shape] in [0, 1] -> penultimate features [B, feature_dim] (post-ReLU)."""
        self._check(images)
        x = images.to(self.head.weight.dtype).flatten(1, -3) * 2.0 - 1.0  # [B, c0, H, W] in [-1, 1]
        return self.embed(self.stage2(self.stage1(x)))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, *input_shape] in [0, 1] -> logits [B, num_classes]."""
        return self.head(self.features(images))

    @torch.no_grad()
    def predict(self, images: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
        """images [B, *input_shape] in [0, 1] -> predicted labels [B] int64 (eval mode, no grad)."""
        self._check(images)
        return torch.cat([self(chunk).argmax(dim=1) for chunk in images.split(batch_size)])

    def save(self, path: str | Path) -> None:
        """Weights as safetensors; the constructor arguments ride along in the file's metadata."""
        from safetensors.torch import save_file

        state = {name: tensor.detach().contiguous().cpu() for name, tensor in self.state_dict().items()}
        save_file(state, str(path), metadata={"config": json.dumps(self.config)})

    @classmethod
    def from_file(cls, path: str | Path, device: str | torch.device = "cpu") -> "ConvClassifier":
        """Inverse of `save`: an eval-mode classifier on `device`."""
        from safetensors import safe_open
        from safetensors.torch import load_file

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"No classifier at {path}; run the training script of its model, e.g. "
                                    f"`python -m dcache.pipelines.train_tiny --out <dir>`.")
        with safe_open(str(path), framework="pt") as handle:
            config = json.loads(handle.metadata()["config"])
        model = cls(channels=tuple(config["channels"]), feature_dim=config["feature_dim"],
                    num_classes=config["num_classes"],
                    input_shape=tuple(config.get("input_shape", (1, IMAGE_SIZE, IMAGE_SIZE))))
        model.load_state_dict(load_file(str(path)))
        return model.to(device).eval()


class DigitClassifier(ConvClassifier):
    """The digits judge: `ConvClassifier` on images [B, 1, 16, 16], 10 classes."""
