"""Every bound on what one request's KV hints may cost us, in one place.

Hints are untrusted input: any API client can send them (vLLM 0.33 copies ``kv_hints`` and
``kv_transfer_params`` from the OpenAI request body). Each bound below caps one dimension of what
an envelope makes us parse, remember or queue; together they cap a request's cost on the
scheduler thread to a fixed multiple of a request without hints:

* parsing: the envelope's JSON text, its actions, the directives of its ``kv.retain`` actions,
  the length of every client string we keep (scopes);
* planning: a request's retention plan is computed once and then only when its blocks pass the
  plan's horizon, which doubles each time (``hints.sessions.RetentionCursor``): a handful of
  plans per request, each costing O(directives), and a table lookup per block;
* remembering: sessions (scopes) per adapter, blocks per session;
* queueing: prefetch actions per request (each queues at most one bounded store job).

And one rule, not a number: a request may raise the retention of blocks others retained, never
lower or release it. Retention is held per *holder* (``hints.sessions.holder``: the request's
tenant and its ``kv.retain`` scope); ``retention.RetentionClasses`` ranks a block by the
strongest of its holders' claims and lets a holder release only its own.
"""

from __future__ import annotations

#: envelope JSON text (``kv_transfer_params`` carries it as text)
MAX_ENVELOPE_JSON_BYTES = 4 << 20
#: actions of one envelope looked at; the rest are counted (``dropped``) and ignored
MAX_ENVELOPE_ACTIONS = 256
#: ``kv.retain`` actions of one envelope; the rest are dropped
MAX_RETAIN_ACTIONS = 16
#: ``kv.retain`` directives of one envelope, all actions together; the rest are dropped
MAX_DIRECTIVES = 128
#: characters of a session scope (``kv.retain`` and ``dtkv.prefetch``)
MAX_SCOPE_CHARS = 256
#: ``dtkv.prefetch`` actions of one envelope acted on; the rest are dropped
MAX_PREFETCH_ACTIONS = 4
#: ``kv.fetch`` actions of one envelope kept (they are only counted)
MAX_FETCH_ACTIONS = 4
#: block hashes of one ``kv.fetch`` action
MAX_FETCH_HASHES = 1 << 16
#: blocks remembered per session scope (for its prefetch and its release)
MAX_SCOPE_BLOCKS = 1 << 16
#: sessions remembered per adapter, least recently used forgotten first
MAX_SCOPES = 1024
#: blocks of one request remembered for its release at session end
MAX_REQUEST_BLOCKS = 1 << 16
