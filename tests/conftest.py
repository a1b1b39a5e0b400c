"""Suite-wide settings: the test models are tiny, so one intra-op thread is fastest (and fair on a 2-core CI)."""

import torch

torch.set_num_threads(1)
