"""Trains the bundled tiny video model (Wan family) and its judge, on CPU, from procedurally drawn motion clips.

    python -m dcache.pipelines.train_motion --out pipelines/assets --threads 1

A `WanTransformer3DModel` (4 blocks, 2 heads x 64 = 128 wide, patch (1, 2, 2)) + `LabelEncoder` learns 5-frame
16x16 clips of a camera pan, the scene moving right / left / down / up (latents [B, 12, 5, 8, 8]: 80 tokens), by
rectified flow, with the transformer's timestep = 1000 t as Wan's sampler passes it; it samples with Wan's UniPC
flow sampler and split CFG at 5. The judge is a `ConvClassifier` over the stacked frames. Writes <out>/tiny-motion/ and
<out>/motion-classifier.safetensors (steps: `train_procedural`). Deterministic for a given seed and thread count.
"""

from diffusers import UniPCMultistepScheduler, WanTransformer3DModel

from .motion_pipeline import MotionClipPipeline
from .procedural_data import CLIP_FRAMES, CLIP_SIZE, MOTION_CLASSES, clips_to_latents, draw_clips
from .train_procedural import Recipe, TrainConfig, main as train_main

# head dim 64: Wan's RoPE splits it into 24 (frames) + 20 (rows) + 20 (columns), 12 / 10 / 10 frequencies. With
# head dim 32 (6 / 5 / 5 frequencies, theta 10000) only the first one or two of each axis turn noticeably over 5
# frames or 4 tokens, and the model learns to move content between tokens far slower (fitting "the previous
# frame" from noise: MSE 0.77 after 150 steps with 3 heads x 32, 0.16 with 2 x 64).
TRANSFORMER_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=64,
    in_channels=12,  # 3 RGB x 2x2 folded pixels
    out_channels=12,
    text_dim=32,
    freq_dim=64,
    ffn_dim=256,
    num_layers=4,
    rope_max_seq_len=64,
)
LABEL_ENCODER_CONFIG = dict(num_classes=len(MOTION_CLASSES), num_tokens=4, joint_attention_dim=32,
                            pooled_projection_dim=0)  # Wan has no pooled text vector
# Wan's sampler as Wan ships it (UniPC, flow prediction on flow sigmas, shifted); 80 tokens need less shift than
# Wan's 3.0 for 480p: sigma' = s sigma / (1 + (s - 1) sigma) with s = 2.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True,
                        flow_shift=2.0, solver_order=2)
DEFAULTS = TrainConfig(steps=1800, classifier_steps=300)

RECIPE = Recipe(
    name="tiny-motion",
    script="train_motion",
    classifier_file="motion-classifier.safetensors",
    class_names=MOTION_CLASSES,
    draw=draw_clips,
    to_latents=clips_to_latents,
    sample_shape=(CLIP_FRAMES, 3, CLIP_SIZE, CLIP_SIZE),
    transformer=WanTransformer3DModel,
    transformer_config=TRANSFORMER_CONFIG,
    label_encoder_config=LABEL_ENCODER_CONFIG,
    scheduler=UniPCMultistepScheduler,
    scheduler_config=SCHEDULER_CONFIG,
    pipeline=MotionClipPipeline,
    defaults=DEFAULTS,
    guidances=(2.0, 3.0),
)


def main(argv: list[str] | None = None) -> dict:
    return train_main(RECIPE, argv)


if __name__ == "__main__":
    main()
