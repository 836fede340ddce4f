"""Tasks: data + model builders behind one protocol (CBOW, recommender, GLM)."""
