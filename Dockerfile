# sandboxd container image: Debian 12 (bookworm), built in two stages.
#   docker build -t sandboxd .        (or /work/shared/tools/container-build . sandboxd)
#   docker run --rm --privileged --init -p 7800:7800 -v sandboxd-state:/var/lib/sandboxd sandboxd
#
# bubblewrap inside a container must be allowed to create user, PID, mount and network
# namespaces (unshare/clone with CLONE_NEW*, mount). Default Docker/podman seccomp and AppArmor
# profiles forbid that: run with --privileged, or with a seccomp profile and AppArmor/SELinux
# policy that allow unshare, clone3, mount and pivot_root (plus --cap-add SYS_ADMIN).
# The lease limits (docs/security.md) also need cgroups the container may write (cgroup v2
# with the memory, pids and cpu controllers, e.g. --cgroupns=private on a delegated host) and
# loop devices for the workspace disks (--privileged gives both); without them the daemon
# refuses to start unless the config sets providers.bwrap.limits.enforce to false.
# --init puts a minimal init at PID 1 to reap stray zombies; sandboxd itself waits on its own
# children through pidfds, not on orphans reparented to it.
# With no tokens in the config, the first start writes an admin token to
# /var/lib/sandboxd/admin.token (read it with `docker exec CONTAINER cat ...`).

# ---- build stage --------------------------------------------------------------------------
FROM debian:bookworm AS build
ARG DEBIAN_FRONTEND=noninteractive
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      build-essential cmake ninja-build pkg-config \
      libboost1.81-dev libboost-program-options1.81-dev nlohmann-json3-dev libspdlog-dev libsqlite3-dev libsystemd-dev libseccomp-dev libssl-dev catch2 \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# The release preset: optimised and hardened (FORTIFY, stack protector, PIE, full RELRO).
RUN cmake --preset release -DSANDBOXD_BUILD_TESTS=OFF -DCMAKE_INSTALL_PREFIX=/usr/local \
 && cmake --build --preset release \
 && cmake --install build/release --prefix /usr/local

# ---- runtime stage ------------------------------------------------------------------------
FROM debian:bookworm-slim
ARG DEBIAN_FRONTEND=noninteractive
# Shared libraries of the release build (Boost, Asio, Beast and nlohmann-json are header-only
# or compiled in): spdlog and its fmt, sqlite, libsystemd (sd_notify), libseccomp (the
# sandboxes' syscall filter), libssl3 (libcrypto: base64, TLS later). bubblewrap is the sandbox
# provider; e2fsprogs formats the workspace disks; ca-certificates for an etcd registry reached
# over TLS.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      bubblewrap e2fsprogs libseccomp2 libspdlog1.10 libfmt9 libboost-program-options1.81.0 libsqlite3-0 libsystemd0 libssl3 ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# sandboxd, sandboxctl and /usr/local/libexec/sandboxd/sandboxd-init.
COPY --from=build /usr/local /usr/local
COPY config/sandboxd.jsonc /etc/sandboxd/sandboxd.jsonc
# The default stateDir: registry.db, admin.token, workspaces. Keep it on a volume so leases
# and the admin token survive a new container.
VOLUME /var/lib/sandboxd
# WebSocket endpoint /v1/ws. The config listens on 127.0.0.1; CMD overrides it with 0.0.0.0 so
# the port can be published. Peers on other hosts need advertiseUrl set in the config.
EXPOSE 7800
ENTRYPOINT ["sandboxd"]
CMD ["--config", "/etc/sandboxd/sandboxd.jsonc", "--listen", "0.0.0.0:7800"]
