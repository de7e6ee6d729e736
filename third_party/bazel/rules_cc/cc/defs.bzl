"""Offline stand-in for @rules_cc//cc:defs.bzl.

Bazel 4.2.3's default WORKSPACE suffix fetches rules_cc with http_archive, and @bazel_tools (tools/cpp, tools/jdk)
loads its rules from @rules_cc//cc:defs.bzl. The real file only forwards to the native rules in Bazel 4.x, so this stub
does the same and nothing more; the WORKSPACE maps @rules_cc here with local_repository so nothing is downloaded.
"""

def cc_binary(**attrs):
    native.cc_binary(**attrs)

def cc_import(**attrs):
    native.cc_import(**attrs)

def cc_library(**attrs):
    native.cc_library(**attrs)

def cc_proto_library(**attrs):
    native.cc_proto_library(**attrs)

def cc_test(**attrs):
    native.cc_test(**attrs)

def cc_toolchain(**attrs):
    native.cc_toolchain(**attrs)

def cc_toolchain_suite(**attrs):
    native.cc_toolchain_suite(**attrs)

def objc_library(**attrs):
    native.objc_library(**attrs)
