# xxHash (XXH3) checksums the bytes the swap manager moves. Used header-only
# (XXH_INLINE_ALL), so nothing is linked and the wheel gains no dependency.
find_path(XXHASH_INCLUDE_DIR xxhash.h)
if(NOT XXHASH_INCLUDE_DIR)
  message(FATAL_ERROR
    "xxhash.h was not found. Install it (Debian/Ubuntu: apt-get install libxxhash-dev; "
    "Fedora/RHEL: dnf install xxhash-devel).")
endif()
add_library(zcore_xxhash INTERFACE)
target_include_directories(zcore_xxhash INTERFACE ${XXHASH_INCLUDE_DIR})
