"""One request through its legs: ``flows`` runs render -> prefill -> decode (-> derender) with the
decisions ``plan`` made, ``poollegs`` and ``decoding`` call the tiers through ``upstream``, and
``clientstream`` writes the client's stream."""
