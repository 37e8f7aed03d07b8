"""Proposers behind one interface (n-gram, Lookahead-Cache, draft model, EAGLE, Medusa).

Arrive with the speculative decoding core issue; nothing here is used yet.
"""
