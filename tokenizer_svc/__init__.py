"""The tokenizer service: Tokenize (text, or chat messages through the model's template) and
incremental Detokenize for the gateway; ``server.py`` serves ``tokenizer.py`` over gRPC."""
