"""What every engine adapter shares: model identity (``identity``, with the audit of vLLM's config
fields in ``identity_fields``) and the session-end flag of a request (``session_flags``). Adapters
import these from here, never from each other.
"""
