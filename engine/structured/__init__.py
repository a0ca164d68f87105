"""Structured outputs: constrain sampling to a JSON schema, a regex, a choice or a grammar.

The grammar engine is llguidance (``spec`` turns a request's constraint into its grammar, ``compiler``
builds and caches matchers, ``bitmask`` applies a step's token masks to the logits). Only ``spec`` is
imported by processes without a model (the gateway validates with it); it does not load torch.
"""

from engine.structured.spec import KINDS, StructuredOutput, check_structured

__all__ = ["KINDS", "StructuredOutput", "check_structured"]
