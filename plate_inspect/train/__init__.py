"""Trainer side: the PLATE layer, the PEFT ``plate`` method, sequential merge-and-rescan, ablation bundles."""
