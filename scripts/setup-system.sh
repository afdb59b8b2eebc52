#!/usr/bin/env bash
# The Debian packages Tangram's real components need, installed when missing: idempotent (checks
# first; `apt-get update` only when something is missing) and quiet (one line per step).
#
#   scripts/setup-system.sh demo   what `make demo` needs: a Python venv, the sandbox and
#                                  redis-server 7 (the embedded broker)
#   scripts/setup-system.sh test   also what the tests use: Docker, iproute2, Chromium, and the
#                                  toolchains of every sandbox language (g++, nodejs, golang-go,
#                                  default-jdk-headless, rustc)
#
# Used by `make demo`, `make test` and `.ci/run`. Not root, or no apt-get: it prints exactly what
# to install. Then `demo` stops (exit 1) only if nothing could work at all (no venv support, no
# redis-server for the embedded broker, or no sandbox: not root and no reachable Docker engine;
# `tangram demo` checks the sandbox for real before it starts anything), while `test` goes on: each test that needs a missing component
# skips with the reason (under CI=true it fails, and so does this script).
set -euo pipefail

profile=${1:-demo}
case "$profile" in demo | test) ;; *)
  echo "usage: $0 demo|test" >&2
  exit 2
  ;;
esac

say() { echo "setup-system: $*"; }

# sbin tools count even when not on a non-root PATH
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }

# package -> "is it there" check. Commands first (works for non-Debian installs too), dpkg-query
# for what has no command of its own.
present() {
  case "$1" in
  python3) have python3 ;;
  python3-venv) have python3 && python3 -c 'import ensurepip, venv' >/dev/null 2>&1 ;;
  bubblewrap) have bwrap ;;
  docker.io) have dockerd ;;
  mmdebstrap) have mmdebstrap ;;
  iproute2) have ip ;;
  iptables) have iptables-restore && have ip6tables-restore ;;
  chromium) have chromium ;;
  g++) have g++ && have gcc ;;
  # toolchains count only where sandboxes see them: under /usr or /bin (not ~/.cargo/bin)
  nodejs) [ -x /usr/bin/node ] || [ -x /usr/local/bin/node ] ;;
  golang-go) [ -x /usr/bin/go ] ;;
  default-jdk-headless) [ -x /usr/bin/javac ] && [ -x /usr/bin/java ] ;;
  rustc) [ -x /usr/bin/rustc ] ;;
  redis-server) [ -x /usr/bin/redis-server ] && getent passwd redis >/dev/null ;;
  *) dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed" ;;
  esac
}

# demo: the venv, bubblewrap (the sandbox's fallback launcher, used when the built-in one
# cannot build a sandbox here; sandbox.namespace_launcher: bwrap asks for it), and Debian's
# redis-server 7: the embedded broker (`broker.url: embedded`) runs /usr/bin/redis-server as
# the unprivileged `redis` user the package creates, with ACL users per role, and gets security
# updates with the system (tangram_celery/transport/broker.py); it also speaks TLS
# (tests/integration/test_tls.py). Its own service is not used (stopped below).
packages=(python3 python3-venv bubblewrap redis-server)
if [ "$profile" = test ]; then
  # tests: a private dockerd (Docker backend), network namespaces (multi-node test) and the
  # sandboxes' egress filter (sandbox.network), the Flower browser test, and gcc/g++ for C
  # actions inside sandboxes
  packages+=(docker.io iproute2 iptables chromium g++)
  # the SWE task images' base root filesystem (tangram_celery/swe/build.py)
  packages+=(mmdebstrap)
  # language toolchains of the sandbox languages (tangram_celery/sandbox/languages.py): the
  # per-language tests need every one; a deployment offers whichever its CPU nodes have
  packages+=(nodejs golang-go default-jdk-headless rustc)
fi

missing=()
for p in "${packages[@]}"; do
  present "$p" || missing+=("$p")
done

if [ ${#missing[@]} -eq 0 ]; then
  say "system packages for '$profile': all present (${packages[*]})"
else
  if [ "$(id -u)" = 0 ] && have apt-get; then
    log=$(mktemp)
    say "installing ${missing[*]} (apt-get; log $log) ..."
    export DEBIAN_FRONTEND=noninteractive
    if apt-get update -qq >"$log" 2>&1 &&
      apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$log" 2>&1; then
      rm -f "$log"
      # Debian starts (and enables) the redis-server service on install: a Redis on port 6379
      # that nothing here uses (the embedded broker and the TLS test start their own), so stop it
      for p in "${missing[@]}"; do
        if [ "$p" = redis-server ] && have systemctl; then
          systemctl disable --now redis-server >/dev/null 2>&1 || true
        fi
      done
      missing=()
      say "installed"
    else
      say "apt-get failed; last lines of $log:"
      tail -n 15 "$log" | sed 's/^/  /'
    fi
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    say "missing Debian packages: ${missing[*]}"
    say "install them with: sudo apt-get install -y ${missing[*]}"
  fi
fi

still_missing() {
  for p in "${missing[@]}"; do [ "$p" = "$1" ] && return 0; done
  return 1
}

if still_missing python3 || still_missing python3-venv; then
  say "cannot create the virtualenv without python3 and python3-venv; install them first"
  exit 1
fi

if [ "$profile" = demo ] && still_missing redis-server; then
  say "the embedded broker needs Debian's redis-server 7 (and its 'redis' user); install it first"
  exit 1
fi

if [ "$profile" = demo ]; then
  # The sandbox: the namespace backend (bubblewrap or the built-in launcher) needs root; the
  # Docker backend needs an engine this user can reach.
  if [ "$(id -u)" != 0 ] && ! (have docker && docker info >/dev/null 2>&1); then
    say "the sandbox needs root (Linux namespaces and cgroups) or a Docker engine you can reach:"
    say "run 'sudo make demo', or start Docker and set sandbox.backend: docker in configs/local.yaml"
    exit 1
  fi
else
  if [ "$(id -u)" != 0 ]; then
    say "not root: tests that need root (sandboxes, cgroups, network namespaces, dockerd) skip"
  fi
fi
if [ "$profile" = test ] && [ ${#missing[@]} -gt 0 ]; then
  if [ -n "${CI:-}" ]; then
    say "CI is set and packages are missing: the tests that need them would fail"
    exit 1
  fi
  say "going on: tests that need ${missing[*]} skip with the reason"
fi
