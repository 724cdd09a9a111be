"""The model families: each module composes the shared layers of pipeline/models/ into one architecture (which
mixer and MLP each layer gets, its caches, its checkpoint's names) and imports no other family.
pipeline/models/registry.py lists them with their facts; docs/adding-a-model.md walks through adding one."""
