"""The tiny digit pipeline for search tests (bundled weights when present, else seeded random weights of the same
architecture) and its calibration set."""

import torch

STEPS = 5


def tiny_pipe():
    from torch import nn

    from dcache.pipelines.bundled import TINY_MODEL_DIR, load_tiny_pipeline

    if (TINY_MODEL_DIR / "model_index.json").is_file():
        return load_tiny_pipeline()
    from diffusers import FluxTransformer2DModel

    from dcache.pipelines.label_encoder import LabelEncoder
    from dcache.pipelines.train_tiny import LABEL_ENCODER_CONFIG, TRANSFORMER_CONFIG, build_pipeline

    torch.manual_seed(0)
    pipe = build_pipeline(nn.ModuleDict({"transformer": FluxTransformer2DModel(**TRANSFORMER_CONFIG),
                                         "label_encoder": LabelEncoder(**LABEL_ENCODER_CONFIG)}))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def psnr(images, reference):
    """The search's quality: float32 PSNR of images in [0, 1]; identical images score a finite 100 dB."""
    from dcache.quality import psnr

    return psnr(images, reference, dtype=torch.float32, floor=1e-20, at_floor=100.0)


def make_calibration(pipe, steps=STEPS, labels=(1, 7), seed=0, guidance=None):
    from dcache.schedules.tuning.search import Calibration

    scale = {} if guidance is None else {"guidance_scale": guidance}

    def generate():
        return pipe(labels=list(labels), num_inference_steps=steps, generator=torch.Generator().manual_seed(seed),
                    output_type="pt", **scale).images

    return Calibration(pipe, generate, psnr)
