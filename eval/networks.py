"""Metrics that need pretrained networks: LPIPS, CLIP score, ImageReward and InceptionV3 features for FID.

Each scorer loads its weights the normal way for users (torchvision / Hugging Face caches; the first use downloads
them) or takes an injected network, which is how the tests run them with small stand-ins and nothing downloaded:

    LpipsScorer()                                  # torchmetrics' LPIPS (AlexNet); needs torchvision
    LpipsScorer(net=my_net)                        # my_net(x, y) -> distances [N, ...], x, y RGB in [-1, 1]
    ClipScorer("openai/clip-vit-base-patch16")     # a hub id or a local folder holding a CLIP model
    ClipScorer(lambda: (clip_model, clip_processor))
    ImageRewardScorer()                            # ImageReward-v1.0 (pip install image-reward)
    ImageRewardScorer(model=obj)                   # obj.score(prompt, PIL image) -> float

A missing package raises MissingExtraError naming the pip extra; weights that cannot be loaded raise
MetricWeightsError saying where the weights come from and how to provide them offline. Every scorer maps images
[N, C, H, W] in [0, 1] (gray is repeated to RGB) to per-image float64 values [N].
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from .metrics import FeatureExtractor, MissingExtraError, check_available

DEFAULT_CLIP = "openai/clip-vit-base-patch16"
DEFAULT_IMAGE_REWARD = "ImageReward-v1.0"


class MetricWeightsError(RuntimeError):
    """A metric's pretrained weights could not be loaded; the message says where they come from and how to provide
    them."""


def _rgb(images: torch.Tensor) -> torch.Tensor:
    return images.repeat(1, 3, 1, 1) if images.shape[1] == 1 else images[:, :3]


def _uint8(images: torch.Tensor) -> torch.Tensor:
    return (_rgb(images).float().clamp(0, 1) * 255).round().to(torch.uint8)


class LpipsScorer:
    """LPIPS distance per image pair [N]; lower = closer. `net(x, y)` takes RGB batches in [-1, 1] and returns one
    distance per pair (shape [N] or [N, 1, 1, 1]); default: torchmetrics' LPIPS network (AlexNet features from
    torchvision's ImageNet weights + the LPIPS linear layers shipped with torchmetrics)."""

    def __init__(self, net: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 net_type: str = "alex", device: str = "cpu", batch: int = 16):
        self.net = net if net is not None else _load_lpips(net_type)
        if isinstance(self.net, torch.nn.Module):
            self.net = self.net.eval().to(device)
        self.device, self.batch = device, batch

    @torch.no_grad()
    def __call__(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from dcache.quality import check_image_pair

        check_image_pair(a, b)
        out = []
        for i in range(0, a.shape[0], self.batch):
            x = _rgb(a[i:i + self.batch]).float().clamp(0, 1).to(self.device) * 2 - 1  # [0, 1] -> [-1, 1]
            y = _rgb(b[i:i + self.batch]).float().clamp(0, 1).to(self.device) * 2 - 1
            out.append(torch.as_tensor(self.net(x, y)).reshape(x.shape[0], -1).mean(1).double().cpu())
        return torch.cat(out)


def _load_lpips(net_type: str) -> torch.nn.Module:
    check_available(["lpips"])
    from torchmetrics.image.lpip import LearnedPerceptualImagePatchSimilarity

    try:
        return LearnedPerceptualImagePatchSimilarity(net_type=net_type, normalize=False).net
    except Exception as exc:  # offline, a corrupt cache, ...
        raise MetricWeightsError(
            f"LPIPS ({net_type}) could not load its networks ({type(exc).__name__}: {exc}). It takes the "
            f"{net_type} ImageNet weights from torchvision, downloaded on first use into "
            f"{Path(torch.hub.get_dir()) / 'checkpoints'} (TORCH_HOME moves it); offline, copy the torchvision "
            f"checkpoint file there, or leave 'lpips' out of --metrics.") from exc


class ClipScorer:
    """Per-image CLIP score 100 * max(cos(E_image(image), E_text(prompt)), 0) (CLIPScore, Hessel et al. 2021; the
    value torchmetrics' CLIPScore reports), with a transformers CLIPModel and CLIPProcessor.

    `model`: a hub id or a local folder (`save_pretrained` layout) holding both, or a callable returning
    (model, processor). Computed here rather than through torchmetrics' CLIPScore: torchmetrics 1.9 reads
    `get_image_features` as a tensor, which transformers >= 5 returns wrapped in an output object.
    """

    def __init__(self, model: str | Callable[[], tuple[Any, Any]] = DEFAULT_CLIP, device: str = "cpu",
                 batch: int = 32):
        self.model, self.processor = model() if callable(model) else _load_clip(model)
        self.model = self.model.eval().to(device)
        self.device, self.batch = device, batch

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        if len(prompts) != images.shape[0]:
            raise ValueError(f"CLIP score needs one prompt per image, got {len(prompts)} prompts for "
                             f"{images.shape[0]} images.")
        limit = getattr(getattr(self.model.config, "text_config", None), "max_position_embeddings", 77)
        out = []
        for i in range(0, images.shape[0], self.batch):
            pixels = self.processor(images=list(_uint8(images[i:i + self.batch])), return_tensors="pt")
            text = self.processor(text=list(prompts[i:i + self.batch]), return_tensors="pt", padding=True,
                                  truncation=True, max_length=limit)
            img = _embedding(self.model.get_image_features(pixel_values=pixels["pixel_values"].to(self.device)))
            txt = _embedding(self.model.get_text_features(input_ids=text["input_ids"].to(self.device),
                                                          attention_mask=text["attention_mask"].to(self.device)))
            cos = torch.nn.functional.cosine_similarity(img.double(), txt.double(), dim=-1)
            out.append((100 * cos).clamp_min(0).cpu())
        return torch.cat(out)


def _embedding(features: Any) -> torch.Tensor:
    """transformers < 5 returns the projected embeddings [N, D]; >= 5 an output object holding them as
    pooler_output."""
    return features if isinstance(features, torch.Tensor) else features.pooler_output


def _load_clip(name: str) -> tuple[Any, Any]:
    check_available(["clip_score"])
    from transformers import CLIPModel, CLIPProcessor

    is_hub_id = name.count("/") == 1 and not name.startswith((".", "/", "~"))  # "org/name"
    if not is_hub_id and not Path(name).expanduser().is_dir():
        raise MetricWeightsError(f"--clip-model {name!r}: no such folder; pass a folder holding a CLIP model saved "
                                 f"with save_pretrained (config.json, weights, tokenizer and preprocessor files) or a "
                                 f"hub id like {DEFAULT_CLIP!r}.")
    try:
        return CLIPModel.from_pretrained(name), CLIPProcessor.from_pretrained(name)
    except Exception as exc:  # offline, auth, a folder without the files
        raise MetricWeightsError(
            f"CLIP score could not load {name!r} ({type(exc).__name__}: {exc}). A hub id downloads into the Hugging "
            f"Face cache on first use (HF_HOME moves it; HF_HUB_OFFLINE=1 reads only the cache); offline, download it "
            f"elsewhere (huggingface-cli download {DEFAULT_CLIP} --local-dir DIR) and pass --clip-model DIR, or leave "
            f"'clip_score' out of --metrics.") from exc


class ImageRewardScorer:
    """ImageReward human-preference score per (prompt, image) [N]. `model`: an object with
    `score(prompt, PIL.Image) -> float` (default: `ImageReward.load(name)`; name = "ImageReward-v1.0" or a
    checkpoint path)."""

    def __init__(self, model: Any = None, name: str = DEFAULT_IMAGE_REWARD, device: str = "cpu"):
        self.model = model if model is not None else _load_image_reward(name, device)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        import PIL.Image

        if len(prompts) != images.shape[0]:
            raise ValueError(f"ImageReward needs one prompt per image, got {len(prompts)} prompts for "
                             f"{images.shape[0]} images.")
        arr = _uint8(images).permute(0, 2, 3, 1).numpy()  # [N, H, W, 3]
        return torch.tensor([float(self.model.score(p, PIL.Image.fromarray(a))) for p, a in zip(prompts, arr)],
                            dtype=torch.float64)


def _load_image_reward(name: str, device: str) -> Any:
    check_available(["image_reward"])
    import ImageReward as RM  # noqa: N813

    try:
        return RM.load(name, device=device)
    except Exception as exc:
        raise MetricWeightsError(
            f"ImageReward could not load {name!r} ({type(exc).__name__}: {exc}). On first use it downloads "
            f"ImageReward.pt and med_config.json (Hugging Face repo THUDM/ImageReward) into ~/.cache/ImageReward and "
            f"the bert-base-uncased tokenizer into the Hugging Face cache; offline, put those files there, or pass "
            f"--image-reward-model /path/to/ImageReward.pt, or leave 'image_reward' out of --metrics.") from exc


class InceptionFeatures(FeatureExtractor):
    """InceptionV3 pool3 features [N, 2048] through torchmetrics' FID network (needs torch-fidelity; the weights
    download on first use, as for any torchmetrics FID)."""

    name = "inception-v3"

    def __init__(self, device: str = "cpu"):
        if importlib.util.find_spec("torch_fidelity") is None:
            raise MissingExtraError("FID with InceptionV3 needs torch-fidelity: pip install 'dcache[metrics]' (or pip "
                                    "install torch-fidelity), or leave 'fid' out of --metrics.")
        from torchmetrics.image.fid import NoTrainInceptionV3

        try:
            self.net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"]).eval().to(device)
        except Exception as exc:
            raise MetricWeightsError(
                f"FID could not load the InceptionV3 weights ({type(exc).__name__}: {exc}). torch-fidelity downloads "
                f"weights-inception-2015-12-05-6726825d.pth into {Path(torch.hub.get_dir()) / 'checkpoints'} on "
                f"first use; offline, copy the file there, or leave 'fid' out of --metrics.") from exc
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> torch.Tensor:
        x = _uint8(images).to(self.device)
        return self.net(x).reshape(x.shape[0], -1).double().cpu()


__all__ = ["LpipsScorer", "ClipScorer", "ImageRewardScorer", "InceptionFeatures", "MetricWeightsError",
           "DEFAULT_CLIP", "DEFAULT_IMAGE_REWARD"]
