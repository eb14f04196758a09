/* libduet.c — libduet.so's own source: none. The shared library is every
 * object of libduet.a (packaging/install.cmake); a target needs one file. */
typedef int duet__libduet_so_has_no_code_of_its_own;
