"""Trains the bundled tiny MM-DiT image model (SD3 family) and its judge, on CPU, from procedurally drawn shapes.

    python -m dcache.pipelines.train_shapes --out pipelines/assets --threads 1

An `SD3Transformer2DModel` (4 joint blocks, 3 heads x 32 = 96 wide, patch 2) + `LabelEncoder` learns 32x32 RGB
images of a red / green / blue circle / square / triangle (9 classes; latents [B, 12, 16, 16]: 64 tokens) by
rectified flow, with the transformer's timestep = 1000 t as SD3's sampler passes it; it samples with
`FlowMatchEulerDiscreteScheduler` and batched CFG at 4. The judge is a `ConvClassifier` of the 9 classes. Writes
<out>/tiny-shapes/ and <out>/shapes-classifier.safetensors (steps: `train_procedural`). Deterministic for a given
seed and thread count.
"""

from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel

from .procedural_data import SHAPE_CLASSES, SHAPE_SIZE, draw_shapes, images_to_latents
from .shapes_pipeline import ShapesPipeline
from .train_procedural import Recipe, TrainConfig, main as train_main

TRANSFORMER_CONFIG = dict(
    sample_size=SHAPE_SIZE // 2,
    patch_size=2,
    in_channels=12,  # 3 RGB x 2x2 folded pixels
    out_channels=12,
    num_layers=4,
    attention_head_dim=32,
    num_attention_heads=3,
    joint_attention_dim=32,
    caption_projection_dim=96,
    pooled_projection_dim=32,
    pos_embed_max_size=SHAPE_SIZE // 4,  # the 8x8 token grid
)
LABEL_ENCODER_CONFIG = dict(num_classes=len(SHAPE_CLASSES), num_tokens=4, joint_attention_dim=32,
                            pooled_projection_dim=32)
# SD3 ships shift 3.0 for 4096 tokens; 64 tokens need less: sigma' = s sigma / (1 + (s - 1) sigma) with s = 2.
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=2.0, use_dynamic_shifting=False)
DEFAULTS = TrainConfig(steps=1500, classifier_steps=300, eval_per_class=20)

RECIPE = Recipe(
    name="tiny-shapes",
    script="train_shapes",
    classifier_file="shapes-classifier.safetensors",
    class_names=SHAPE_CLASSES,
    draw=draw_shapes,
    to_latents=images_to_latents,
    sample_shape=(3, SHAPE_SIZE, SHAPE_SIZE),
    transformer=SD3Transformer2DModel,
    transformer_config=TRANSFORMER_CONFIG,
    label_encoder_config=LABEL_ENCODER_CONFIG,
    scheduler=FlowMatchEulerDiscreteScheduler,
    scheduler_config=SCHEDULER_CONFIG,
    pipeline=ShapesPipeline,
    defaults=DEFAULTS,
    guidances=(2.0,),
)


def main(argv: list[str] | None = None) -> dict:
    return train_main(RECIPE, argv)


if __name__ == "__main__":
    main()
