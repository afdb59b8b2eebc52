#!/bin/sh
# What the public redis image's entrypoint does for redis-server: started as root, it owns the
# data directory to the redis user and runs the server as that user (setpriv: util-linux).
set -eu
if [ "${1:-}" = redis-server ] && [ "$(id -u)" = 0 ]; then
  chown -R redis:redis .
  exec setpriv --reuid=redis --regid=redis --init-groups "$@"
fi
exec "$@"
