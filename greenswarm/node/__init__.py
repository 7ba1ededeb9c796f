"""A site: its node, inner trainer, model, data, checkpoints and progress records."""
