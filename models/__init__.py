"""CTR-DNN, DeepFM and Word2Vec: forward, hand-written backward and predict over numpy arrays."""
