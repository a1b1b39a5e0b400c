"""Stand-in networks for the metrics that need pretrained weights (nothing is downloaded in tests):

- `SquaredError`: an LPIPS-shaped network whose distance is known in closed form: mean (x - y)^2 over RGB pixels in
  [-1, 1], i.e. 4 x the MSE of the [0, 1] images, so LPIPS = 4 * 10^(-PSNR / 10) for every image.
- `tiny_clip()`: a real transformers CLIPModel + CLIPProcessor with random weights (16x16 images, 2 heads, 1 layer,
  a word-level tokenizer), to run the CLIP score code against the library's actual API.
- `Brightness`: an ImageReward-shaped object, score(prompt, image) = mean pixel / 255 + number of words.
"""

from __future__ import annotations

import numpy as np
import torch

from tiny_video import tiny_tokenizer


class SquaredError(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.seen: list[tuple[tuple[int, ...], float, float]] = []  # (shape, min, max) of every input

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.seen += [(tuple(t.shape), float(t.min()), float(t.max())) for t in (x, y)]
        return ((x - y) ** 2).mean(dim=(1, 2, 3), keepdim=True)  # [N, 1, 1, 1], like torchmetrics' LPIPS net


def tiny_clip(seed: int = 0):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    config = CLIPConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=None, eos_token_id=1,
                         pad_token_id=0),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=16, patch_size=8),
        projection_dim=8)
    processor = CLIPProcessor(image_processor=CLIPImageProcessor(size={"shortest_edge": 16},
                                                                 crop_size={"height": 16, "width": 16}),
                              tokenizer=tokenizer)
    return CLIPModel(config).eval(), processor


class Brightness:
    def __init__(self):
        self.seen: list[tuple[str, str, tuple[int, int]]] = []  # (prompt, PIL mode, size)

    def score(self, prompt: str, image) -> float:
        self.seen.append((prompt, image.mode, image.size))
        return float(np.asarray(image, dtype=np.float64).mean() / 255 + len(prompt.split()))
