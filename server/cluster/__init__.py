"""A cluster of engine replicas on Ray Serve (`python -m server cluster`; docs/deploy.md).

`application.py` builds the Ray Serve application and runs its process; `ingress.py` is the one HTTP entry;
`replica.py` is one whole server as a replica; `forwarding.py` carries a request from the one to the other;
`router.py` is the cache-aware request router and `routing_key.py` what it reads of a request. Only this
package imports Ray.
"""
