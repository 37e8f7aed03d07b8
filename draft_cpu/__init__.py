"""The CPU draft worker (AMX via IPEX or native PyTorch, core placement, rollback KV).

Arrives with the CPU draft worker issue; nothing here is used yet.
"""
