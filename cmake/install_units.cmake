# What `cmake --install` puts in place for running sandboxd under systemd: the two units of
# systemd/ with their paths rewritten to this install, the config where the units read it, and
# a modules-load.d file for the loop module. Included by the top-level CMakeLists.txt, after
# GNUInstallDirs. Each directory may be given with -D: SANDBOXD_CONFIG_DIR,
# SANDBOXD_SYSTEMD_UNIT_DIR, SANDBOXD_MODULES_LOAD_DIR.
#
# The prefixes /usr and /usr/local install for the system itself: the config goes to
# /etc/sandboxd (not /usr/local/etc), and the units and modules-load.d file to directories
# systemd reads (for /usr those pkg-config's systemd.pc names; /usr/local/lib/systemd/system
# and /usr/local/lib/modules-load.d otherwise). Any other prefix is a private install: every
# file stays under it (<sysconfdir>/sandboxd, <prefix>/lib/systemd/system, ...), and the
# units name those paths; link or copy them into /etc/systemd/system to use them. A prefix
# under /home does not work with the units: ProtectHome=yes hides it from the daemon.

get_filename_component(_sandboxd_units_src "${CMAKE_CURRENT_LIST_DIR}/.." ABSOLUTE)
string(REGEX REPLACE "(.)/+$" "\\1" _sandboxd_prefix "${CMAKE_INSTALL_PREFIX}")

if(NOT SANDBOXD_CONFIG_DIR)
  if(_sandboxd_prefix STREQUAL "/usr" OR _sandboxd_prefix STREQUAL "/usr/local")
    set(SANDBOXD_CONFIG_DIR /etc/sandboxd)
  else()
    set(SANDBOXD_CONFIG_DIR ${CMAKE_INSTALL_FULL_SYSCONFDIR}/sandboxd)
  endif()
endif()

# systemd.pc's directories belong to systemd's own prefix (/usr, or / for the units on
# Debian): right for a /usr install only, not for /usr/local or a private prefix.
set(_sandboxd_pc_unit_dir "")
set(_sandboxd_pc_modules_dir "")
if(_sandboxd_prefix STREQUAL "/usr")
  find_package(PkgConfig QUIET)
  if(PKG_CONFIG_FOUND)
    pkg_get_variable(_sandboxd_pc_unit_dir systemd systemdsystemunitdir)
    pkg_get_variable(_sandboxd_pc_modules_dir systemd modulesloaddir)
  endif()
endif()
if(NOT SANDBOXD_SYSTEMD_UNIT_DIR)
  if(_sandboxd_pc_unit_dir)
    set(SANDBOXD_SYSTEMD_UNIT_DIR ${_sandboxd_pc_unit_dir})
  else()
    set(SANDBOXD_SYSTEMD_UNIT_DIR ${CMAKE_INSTALL_PREFIX}/lib/systemd/system)
  endif()
endif()
if(NOT SANDBOXD_MODULES_LOAD_DIR)
  if(_sandboxd_pc_modules_dir)
    set(SANDBOXD_MODULES_LOAD_DIR ${_sandboxd_pc_modules_dir})
  else()
    set(SANDBOXD_MODULES_LOAD_DIR ${CMAKE_INSTALL_PREFIX}/lib/modules-load.d)
  endif()
endif()

# The units as installed: systemd/*.service name /usr/local/bin/sandboxd and /etc/sandboxd/
# (the default prefix); both are rewritten here to this install's bindir and config directory.
# The rewrite fails the configure step when a unit no longer names them, rather than install
# a unit that runs some other binary.
set(_sandboxd_units_out ${CMAKE_CURRENT_BINARY_DIR}/systemd)
foreach(unit sandboxd.service sandboxd@.service)
  set(_source ${_sandboxd_units_src}/systemd/${unit})
  set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_source})
  file(READ ${_source} _text)
  foreach(needle "ExecStart=/usr/local/bin/sandboxd " "--config /etc/sandboxd/")
    string(FIND "${_text}" "${needle}" _at)
    if(_at EQUAL -1)
      message(FATAL_ERROR "${_source} does not contain \"${needle}\", which "
                          "cmake/install_units.cmake rewrites to the installed path")
    endif()
  endforeach()
  string(REPLACE "/usr/local/bin/sandboxd" "${CMAKE_INSTALL_FULL_BINDIR}/sandboxd"
         _text "${_text}")
  string(REPLACE "/etc/sandboxd/" "${SANDBOXD_CONFIG_DIR}/" _text "${_text}")
  # Written through configure_file so that an unchanged unit keeps its timestamp.
  file(WRITE ${_sandboxd_units_out}/${unit}.new "${_text}")
  configure_file(${_sandboxd_units_out}/${unit}.new ${_sandboxd_units_out}/${unit} COPYONLY)
  install(FILES ${_sandboxd_units_out}/${unit} DESTINATION ${SANDBOXD_SYSTEMD_UNIT_DIR})
endforeach()

# The drop-in for leases with egress (issue 48), not enabled: an operator who turns egress on
# copies it to /etc/systemd/system/sandboxd.service.d/ (it says why it adds CAP_NET_ADMIN).
install(FILES ${_sandboxd_units_src}/systemd/egress.conf
        DESTINATION ${CMAKE_INSTALL_DATADIR}/sandboxd/systemd)

# Workspace disks are loop-mounted ext4 images, and the units' DeviceAllow=block-loop is
# resolved when the unit starts: the loop module must be loaded before (at boot, by
# systemd-modules-load.service). A kernel with loop built in ignores the file.
file(CONFIGURE OUTPUT ${_sandboxd_units_out}/sandboxd-modules-load.conf
     CONTENT "# sandboxd: lease workspaces are loop-mounted filesystem images.\nloop\n")
install(FILES ${_sandboxd_units_out}/sandboxd-modules-load.conf
        DESTINATION ${SANDBOXD_MODULES_LOAD_DIR} RENAME sandboxd.conf)

# The config, where the units' --config names it. An existing sandboxd.jsonc is the
# operator's and is kept; the shipped one then lands beside it as sandboxd.jsonc.default.
# Mode 0640: operators add tokens to it.
set(_sandboxd_config_src ${_sandboxd_units_src}/config/sandboxd.jsonc)
install(CODE "
  set(_config_dir \"${SANDBOXD_CONFIG_DIR}\")
  set(_rename \"\")
  if(EXISTS \"\$ENV{DESTDIR}\${_config_dir}/sandboxd.jsonc\")
    message(STATUS \"Keeping: \$ENV{DESTDIR}\${_config_dir}/sandboxd.jsonc\")
    set(_rename RENAME sandboxd.jsonc.default)
  endif()
  file(INSTALL DESTINATION \"\${_config_dir}\" TYPE FILE
       PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ
       FILES \"${_sandboxd_config_src}\" \${_rename})
")

message(STATUS "systemd units: ${SANDBOXD_SYSTEMD_UNIT_DIR}; config: "
               "${SANDBOXD_CONFIG_DIR}/sandboxd.jsonc; modules-load.d: "
               "${SANDBOXD_MODULES_LOAD_DIR}")
