"""Evaluation of frozen backbones: k-NN, linear probe, the paper's figures, pictures of the features.

- checkpoints.py  load_backbone / load_classifier: any checkpoint -> a feature backbone
- features.py     extract_features and the on-disk feature cache (features_for)
- knn.py          knn_classify / knn_evaluate (DINO protocol, exact, FAISS or torch),
                  online_knn for trainers, and the `knn` command
- linear.py       train_linear_on_features (many lrs at once) and the `linear` command
- viz.py          cross-patch rows, sparsity, training curves and the two pictures below:
                  the `viz` command
- neighbours.py   a few test images with the k-NN's own nearest training images
- patch_pca.py    patch tokens before pooling on their first principal components
- command.py      what the three commands share (backbone, features, output, JSON)

Import from the modules (resmlp.eval.knn, ...); this file imports nothing so that a
command pays only for what it uses.
"""
