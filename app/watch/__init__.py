"""Watch: every change of every group pushed to decoders, routers and operators as it lands.

``feed`` follows the store (one change stream per replica) and turns its revisions into
group events; ``history`` keeps the last of them; ``stream`` serves them to watchers
(``GET /tp-groups?watch=true``); ``pages`` answers lists in pages from one snapshot."""
