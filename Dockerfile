# sandboxd container image: Debian 12 (bookworm). Targets:
#   runtime (the default, last): compiles the project in the `build` stage, then the runtime
#            image with what `cmake --install` laid out under /usr/local.
#     podman build --format docker -t sandboxd .        (docker build -t sandboxd .)
#     BUILDAH_FORMAT=docker ../shared/tools/container-build . sandboxd
#   prebuilt: the same runtime image from binaries built on the host, without compiling. The
#            build context holds this file, config/sandboxd.jsonc and prebuilt/usr/local/ as
#            `DESTDIR=CONTEXT/prebuilt cmake --install build/release` lays it out (at least
#            bin/sandboxd, bin/sandboxctl and libexec/sandboxd/sandboxd-init, which is all
#            tests/container/check_image copies before it builds `--target prebuilt`).
# Build arguments: VERSION (the version label; default the project's version) and SOURCE (the
# repository URL for the source label: --build-arg SOURCE=https://...).
# podman keeps HEALTHCHECK only in Docker-format images: build with --format docker (or
# BUILDAH_FORMAT=docker); its default OCI format drops it with a warning.
#
# Running it: README.md, "In a container", has the flags, what each is for and the error
# without it (measured with podman 4.3, runc, cgroup v1; tests/container/check_image runs the
# first form). --privileged is not needed:
#   providers.bwrap.limits.enforce: false (a config mounted at /etc/sandboxd/sandboxd.jsonc):
#     podman run -d --read-only --cap-drop ALL --cap-add CHOWN --cap-add DAC_OVERRIDE \
#       --cap-add FOWNER --cap-add KILL --cap-add SETUID --cap-add SETGID \
#       --security-opt 'unmask=/proc/*' --security-opt seccomp=sandboxd-seccomp.json ...
#     (bubblewrap mounts a fresh /proc in each lease's user namespace, which the kernel refuses
#     while masked paths cover parts of the container's /proc; and it names the lease's UTS
#     namespace with sethostname(), which podman's seccomp profile allows only with
#     CAP_SYS_ADMIN: sandboxd-seccomp.json is that profile with sethostname allowed.)
#   limits enforced: the same capabilities plus SYS_ADMIN (loop mounts; it also lets the
#     default seccomp profile allow sethostname: no seccomp option), writable cgroups (on
#     cgroup v1: a tmpfs at /sys/fs/cgroup with the host's memory, pids, cpu, cpuacct and
#     freezer hierarchies bound into it), and --device /dev/loop-control plus one
#     --device /dev/loopN per lease that may exist at once.
#
# PID 1 is tini (Debian's package, the ENTRYPOINT): it forwards SIGTERM and SIGINT to sandboxd
# (which drains, docs/protocol.md section 7) and reaps orphans reparented to PID 1 (sandboxd
# waits on its own children through pidfds and leaves others as zombies). Do not add --init.
#
# The user is root, and must be: sandboxd chowns each lease's directories to the lease's own
# host uid (CAP_CHOWN) and starts its bubblewrap as that uid (setgroups, setresuid: CAP_SETGID,
# CAP_SETUID), counting on the change away from uid 0 to clear every capability; with limits
# enforced it also loop-mounts the workspace disks (CAP_SYS_ADMIN) and writes root's cgroup
# directories. As uid 1000 (--user 1000:1000, /run/sandboxd and stateDir made writable for
# it), every leaseAcquire fails: with no capabilities, "cannot make
# /run/sandboxd/<instance>/bw-... for its lease: Operation not permitted"; with podman's
# --cap-add (ambient capabilities for a non-root user, which setresuid between two non-zero
# uids keeps), "bwrap: Unexpected capabilities but not setuid, old file caps config?". The
# sandboxed commands run as those unprivileged uids, with no capability outside their user
# namespace; --cap-drop ALL leaves root in the container only the capabilities added back.
#
# With no tokens in the config, the first start writes an admin token to
# /var/lib/sandboxd/admin.token (read it with `podman exec CONTAINER cat ...`).

# ---- build stage --------------------------------------------------------------------------
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libboost1.81-dev libboost-program-options1.81-dev nlohmann-json3-dev libspdlog-dev libsqlite3-dev libsystemd-dev libseccomp-dev libssl-dev catch2 \
      libnftables-dev libnl-3-dev libnl-route-3-dev libldns-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The release preset: optimised and hardened (FORTIFY, stack protector, PIE, full RELRO).
# DESTDIR keeps what the install writes outside the prefix (the systemd units' config in
# /etc/sandboxd) out of the copy below.
RUN cmake --preset release -DSANDBOXD_BUILD_TESTS=OFF -DCMAKE_INSTALL_PREFIX=/usr/local \
 && cmake --build --preset release \
 && DESTDIR=/install cmake --install build/release

# ---- runtime base: everything but the binaries ------------------------------------------
FROM debian:bookworm-slim AS base
ARG DEBIAN_FRONTEND=noninteractive
# Shared libraries of the release build (Boost, Asio, Beast and nlohmann-json are header-only
# or compiled in): spdlog and its fmt, sqlite, libsystemd (sd_notify), libseccomp (the
# sandboxes' syscall filter), libssl3 (TLS, libcrypto). bubblewrap is the sandbox provider;
# e2fsprogs formats the workspace disks; ca-certificates for an etcd registry reached over
# TLS; tini is PID 1.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      bubblewrap e2fsprogs tini libseccomp2 libspdlog1.10 libfmt9 libboost-program-options1.81.0 libsqlite3-0 libsystemd0 libssl3 ca-certificates \
      libnftables1 libnl-3-200 libnl-route-3-200 libldns3 \
 && apt-get clean \
 && rm -rf /var/lib/apt/lists/*
ARG VERSION=0.1.0
ARG SOURCE=
# licenses: MIT as clients/node/package.json declares it; the repository has no LICENSE file.
LABEL org.opencontainers.image.title="sandboxd" \
      org.opencontainers.image.description="A sandbox-host daemon: leases bubblewrap sandboxes to tenants and runs untrusted commands in them over duplex channels on one WebSocket" \
      org.opencontainers.image.source="${SOURCE}" \
      org.opencontainers.image.licenses="MIT" \
      org.opencontainers.image.version="${VERSION}"
COPY config/sandboxd.jsonc /etc/sandboxd/sandboxd.jsonc
# The default stateDir: registry.db, admin.token, workspaces. Keep it on a volume so leases
# and the admin token survive a new container.
VOLUME /var/lib/sandboxd
# WebSocket endpoint /v1/ws, and /healthz, /readyz, /metrics. The config listens on
# 127.0.0.1; CMD overrides it with 0.0.0.0 so the port can be published. Peers on other hosts
# need advertiseUrl set in the config.
EXPOSE 7800
# Healthy while GET /readyz answers 200 ("ready"; 503 "not ready: <why>" otherwise), over
# plain HTTP on 127.0.0.1:$SANDBOXD_HEALTHCHECK_PORT, through bash's /dev/tcp (the image has
# no curl). Listening elsewhere, set SANDBOXD_HEALTHCHECK_PORT (podman/docker run -e); with
# tls, add "plainListen": "127.0.0.1:PORT" to the config and name that port.
ENV SANDBOXD_HEALTHCHECK_PORT=7800
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
  CMD ["bash", "-c", "exec 3<>/dev/tcp/127.0.0.1/\"$SANDBOXD_HEALTHCHECK_PORT\" && printf 'GET /readyz HTTP/1.0\\r\\n\\r\\n' >&3 && read -r -t 8 version status rest <&3 && [ \"$status\" = 200 ]"]
ENTRYPOINT ["/usr/bin/tini", "--", "/usr/local/bin/sandboxd"]
CMD ["--config", "/etc/sandboxd/sandboxd.jsonc", "--listen", "0.0.0.0:7800"]

# ---- prebuilt: the runtime image from the host's build (see the top) ----------------------
FROM base AS prebuilt
COPY prebuilt/usr/local/ /usr/local/

# ---- runtime (default) --------------------------------------------------------------------
FROM base AS runtime
COPY --from=build /install/usr/local/ /usr/local/
