# syntax=docker/dockerfile:1
# A plugin image for the custom-plugin overlay: builds plugins/examples/
# ban_tokens.c against the SDK header and ships the library in /plugins of a
# small image with a shell (the init container copies it out).
#   docker build -f k8s/overlays/custom-plugin/plugin.Dockerfile \
#     -t registry.example.com/samplerd-plugin-ban-tokens:1.0.0 .
ARG DEBIAN_RELEASE=bookworm

FROM gcc:14-${DEBIAN_RELEASE} AS build
WORKDIR /src
COPY plugins/sdk/include plugins/sdk/include
COPY plugins/examples/ban_tokens.c plugins/examples/ban_tokens.c
RUN cc -std=c11 -O2 -shared -fPIC -I plugins/sdk/include \
      plugins/examples/ban_tokens.c -o /libban_tokens.so

FROM busybox:1.37
COPY --from=build /libban_tokens.so /plugins/libban_tokens.so
USER 10001:10001
