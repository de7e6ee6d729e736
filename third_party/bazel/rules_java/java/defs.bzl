"""Offline stand-in for @rules_java//java:defs.bzl.

Bazel 4.2.3 registers the toolchains in @bazel_tools//tools/jdk:all for every build, and that package loads
java_import / java_runtime / java_toolchain from @rules_java, which the default WORKSPACE suffix would download.
ft_jax builds only C++, so forwarding to the native rules (what the real file does in Bazel 4.x) is all it needs;
no Java toolchain is ever resolved, hence no remote_java_tools download either.
"""

def java_binary(**attrs):
    native.java_binary(**attrs)

def java_import(**attrs):
    native.java_import(**attrs)

def java_library(**attrs):
    native.java_library(**attrs)

def java_lite_proto_library(**attrs):
    native.java_lite_proto_library(**attrs)

def java_package_configuration(**attrs):
    native.java_package_configuration(**attrs)

def java_plugin(**attrs):
    native.java_plugin(**attrs)

def java_proto_library(**attrs):
    native.java_proto_library(**attrs)

def java_runtime(**attrs):
    native.java_runtime(**attrs)

def java_test(**attrs):
    native.java_test(**attrs)

def java_toolchain(**attrs):
    native.java_toolchain(**attrs)
