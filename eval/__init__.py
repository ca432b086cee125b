"""Evaluation of frozen backbones and the commands that read finished runs.

- features.py     extract_features and the on-disk feature cache (features_for)
- knn.py          knn_classify / knn_evaluate (DINO protocol, exact, FAISS or torch),
                  online_knn for trainers, and the `knn` command
- linear.py       train_linear_on_features (many lrs at once) and the `linear` command
- viz.py          cross-patch rows, sparsity and training curves: the `viz` command
- export.py       a run's backbone for timm / the official code / safetensors: `export`
- command.py      what the knn / linear / viz commands share (backbone, features, output)

Checkpoints come in through resmlp.models.load. Import from the modules
(resmlp.eval.knn, ...); this file imports nothing so that a command pays only for what
it uses.
"""
