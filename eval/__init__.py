"""Evaluation of frozen backbones: k-NN, linear probe, the paper's figures.

- checkpoints.py  load_backbone / load_classifier: any checkpoint -> a feature backbone
- features.py     extract_features and the on-disk feature cache (features_for)
- knn.py          knn_classify / knn_evaluate (DINO protocol, exact, FAISS or torch),
                  online_knn for trainers, and the `knn` command
- linear.py       train_linear_on_features (many lrs at once) and the `linear` command
- viz.py          cross-patch rows, sparsity and training curves: the `viz` command
- command.py      what the three commands share (backbone, features, output, JSON)

Import from the modules (resmlp.eval.knn, ...); this file imports nothing so that a
command pays only for what it uses.
"""
