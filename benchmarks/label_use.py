"""How much a bundled procedural model's prediction depends on its label: the training loss on held-out samples
noised to t with the requested label and with the null label, and the relative change of the prediction.

    python benchmarks/label_use.py                    # tiny-motion and tiny-shapes, a markdown table each
    python benchmarks/label_use.py --models motion

A model that follows its prompts has a clearly lower loss with its label at high t (the label decides what the
sample will be); one whose loss is the same with the null label ignores it, and CFG on it changes little.
"""

from __future__ import annotations

import argparse

MODELS = {"motion": ("load_motion_pipeline", "train_motion"),  # loader in dcache.pipelines.bundled, training recipe
          "shapes": ("load_shapes_pipeline", "train_shapes")}
TIMES = (0.9, 0.7, 0.5, 0.3)


def label_use(name: str, per_class: int, seed: int) -> list[tuple[float, float, float, float]]:
    """[(t, loss with the label, loss with the null label, |v_label - v_null| / |v_label|)] on per_class held-out
    samples of every class (drawn from `seed`, one noise draw)."""
    import importlib

    import torch

    from dcache.pipelines import bundled
    from dcache.pipelines.procedural_data import held_out
    from dcache.pipelines.train_procedural import velocity

    loader, script = MODELS[name]
    recipe = importlib.import_module(f"dcache.pipelines.{script}").RECIPE
    torch.set_num_threads(1)
    pipe = getattr(bundled, loader)()
    model = torch.nn.ModuleDict({"transformer": pipe.transformer, "label_encoder": pipe.label_encoder})
    samples, labels = held_out(recipe.draw, len(recipe.class_names), per_class, seed)
    x0 = recipe.to_latents(samples)
    noise = torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed))
    target = noise - x0  # what the model is trained to predict, at every t
    null = torch.full_like(labels, pipe.label_encoder.null_label)
    rows = []
    with torch.no_grad():
        for t in TIMES:
            t_batch = torch.full((len(labels),), t)
            x_t = (1 - t) * x0 + t * noise
            with_label, with_null = velocity(model, x_t, labels, t_batch), velocity(model, x_t, null, t_batch)
            rows.append((t, torch.nn.functional.mse_loss(with_label, target).item(),
                         torch.nn.functional.mse_loss(with_null, target).item(),
                         ((with_label - with_null).norm() / with_label.norm()).item()))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--per-class", type=int, default=16, help="held-out samples per class")
    ap.add_argument("--seed", type=int, default=7, help="held-out draw and noise seed")
    args = ap.parse_args()
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"--models: unknown {name!r}; choose from {', '.join(MODELS)}")
        rows = label_use(name, args.per_class, args.seed)
        print(f"\ntiny-{name}\n")
        print("| t | " + " | ".join(f"{t}" for t, *_ in rows) + " |")
        print("|---|" + "---|" * len(rows))
        print("| loss, requested label | " + " | ".join(f"{a:.4f}" for _, a, _, _ in rows) + " |")
        print("| loss, null label | " + " | ".join(f"{b:.4f}" for _, _, b, _ in rows) + " |")
        print("| change of the prediction, requested vs null label | "
              + " | ".join(f"{100 * c:.1f} %" for *_, c in rows) + " |")


if __name__ == "__main__":
    main()
