"""Training of the embedded default models (tokenizer, target, draft) on the Python standard library.

Kept out of `engine/` so that serving never imports training code; `specstep train-defaults` runs it.
"""
