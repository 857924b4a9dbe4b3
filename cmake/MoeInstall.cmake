# `cmake --install` puts the services and the C++ client SDK under the prefix: bin/ (the three
# services and moe-cli, which runs the services next to it), include/moe-serving/ (the SDK's
# headers and the generated wire contract: moe/, inference/ and etcd/ under the project's own
# folder, not at the top of the user's include tree), lib/ (the SDK's static libraries) and
# lib/cmake/MoeClient (an exported package whose include directory is include/moe-serving), so
# that a C++ user writes
#
#   find_package(MoeClient REQUIRED)
#   target_link_libraries(app PRIVATE moe::moe_client)
#
# The SDK is moe_client (MoeClient, RouterLink) on moe_transport_client, moe_proto and
# moe_tensor (and moe_temp_dir, which its TLS uses); it needs gRPC, protobuf and Abseil (found
# again by the package), not gRPC's reflection library.
include(GNUInstallDirs)
include(CMakePackageConfigHelpers)

install(TARGETS router-svc attention-svc expert-svc moe-cli RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
install(TARGETS moe_client moe_transport_client moe_temp_dir moe_proto moe_tensor
        EXPORT MoeClientTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moe-serving)
install(FILES services/client/moe_client.h services/client/router_link.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moe-serving/services/client)
install(FILES services/tensor/bf16.h services/tensor/dtype.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moe-serving/services/tensor)
install(FILES services/transport/channel.h services/transport/security.h
              services/transport/status_convert.h
              services/transport/tensor_codec.h services/transport/health_check.h
              services/transport/expert_stream.h
        DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moe-serving/services/transport)
install(DIRECTORY ${PROJECT_BINARY_DIR}/proto_gen/ DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}/moe-serving
        FILES_MATCHING PATTERN "*.pb.h")
install(EXPORT MoeClientTargets NAMESPACE moe:: DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoeClient)
configure_package_config_file(cmake/MoeClientConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/MoeClientConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoeClient)
write_basic_package_version_file(${PROJECT_BINARY_DIR}/MoeClientConfigVersion.cmake
                                 VERSION 0.1.0 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/MoeClientConfig.cmake
              ${PROJECT_BINARY_DIR}/MoeClientConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/MoeClient)
