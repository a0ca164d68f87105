"""Speculative decoding: proposers guess a request's next tokens, one forward pass of the target model checks
them all, and every guess the target agrees with is a token for (almost) free.

``proposer`` is the interface, ``ngram`` (prompt lookup) and ``draft`` (a smaller model) the proposers,
``verify`` turns the target's logits over the proposals into accepted tokens, ``control`` decides per step
who speculates and how far (backing off where it does not pay).
"""
