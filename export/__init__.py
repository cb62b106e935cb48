"""Checkpoint → bundle: resolve a model, build static-KV stage graphs, quantize, write a bundle.

Uses torch and transformers; the runtime never imports this package.
"""
