/* Real (linkable) functions for libfabric's static-inline API, which bindgen cannot bind.
 * Each wrapper forwards its arguments unchanged; see the libfabric man pages for semantics. */
#ifndef FABRIC_SHIM_H
#define FABRIC_SHIM_H
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_rma.h>

uint32_t shim_fi_version(void);
struct fi_info *shim_fi_allocinfo(void);
int shim_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int shim_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context);
int shim_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context);
int shim_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context);
int shim_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context);
int shim_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int shim_fi_enable(struct fid_ep *ep);
int shim_fi_close(struct fid *fid);
int shim_fi_getname(struct fid *fid, void *addr, size_t *addrlen);
int shim_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags, void *context);
int shim_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                   uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context);
/* The version of the libfabric that runs (fi_version()), which may be newer than these headers. */
uint32_t shim_fi_runtime_version(void);

/* libfabric >= 1.20 ABI, declared by hand: the bindings are generated from older headers (1.17),
 * which have neither. Layouts as in libfabric 2.x's fi_domain.h; shim.c checks them against the
 * real declarations whenever it is compiled with headers that have them. */
#define SHIM_FI_MR_DMABUF (1ULL << 40)
struct shim_fi_mr_dmabuf {
    int fd;
    uint64_t offset;
    size_t len;
    void *base_addr;
};

/* Registers one range with fi_mr_regattr. `iov` (host or device virtual addresses) or, with
 * SHIM_FI_MR_DMABUF in `flags`, `dmabuf` describes it (the other is NULL); `cuda_device` >= 0 sets
 * iface = FI_HMEM_CUDA of that device, -1 leaves FI_HMEM_SYSTEM. The attribute passed to libfabric
 * has the full 2.x layout (unused fields zero), so it is read correctly whatever API version the
 * domain was opened with. */
int shim_fi_mr_regattr2(struct fid_domain *domain, const struct iovec *iov, const struct shim_fi_mr_dmabuf *dmabuf,
                        uint64_t access, uint64_t requested_key, int cuda_device, uint64_t flags,
                        struct fid_mr **mr);
void *shim_fi_mr_desc(struct fid_mr *mr);
uint64_t shim_fi_mr_key(struct fid_mr *mr);
int shim_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int shim_fi_mr_enable(struct fid_mr *mr);
ssize_t shim_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                          fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context);
ssize_t shim_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                      uint64_t addr, uint64_t key, void *context);
ssize_t shim_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags);
ssize_t shim_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, uint64_t addr,
                     uint64_t key, void *context);
ssize_t shim_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context);
ssize_t shim_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags);
ssize_t shim_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context);
ssize_t shim_fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t shim_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
const char *shim_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len);
#endif
