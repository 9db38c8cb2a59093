#include "shim.h"

#include <stddef.h>
#include <string.h>

uint32_t shim_fi_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
struct fi_info *shim_fi_allocinfo(void) { return fi_allocinfo(); }
int shim_fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context) {
    return fi_fabric(attr, fabric, context);
}
int shim_fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain, void *context) {
    return fi_domain(fabric, info, domain, context);
}
int shim_fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep, void *context) {
    return fi_endpoint(domain, info, ep, context);
}
int shim_fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq, void *context) {
    return fi_cq_open(domain, attr, cq, context);
}
int shim_fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av, void *context) {
    return fi_av_open(domain, attr, av, context);
}
int shim_fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags) { return fi_ep_bind(ep, bfid, flags); }
int shim_fi_enable(struct fid_ep *ep) { return fi_enable(ep); }
int shim_fi_close(struct fid *fid) { return fi_close(fid); }
int shim_fi_getname(struct fid *fid, void *addr, size_t *addrlen) { return fi_getname(fid, addr, addrlen); }
int shim_fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr, uint64_t flags,
                      void *context) {
    return fi_av_insert(av, addr, count, fi_addr, flags, context);
}
int shim_fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access, uint64_t offset,
                   uint64_t requested_key, uint64_t flags, struct fid_mr **mr, void *context) {
    return fi_mr_reg(domain, buf, len, access, offset, requested_key, flags, mr, context);
}
uint32_t shim_fi_runtime_version(void) { return fi_version(); }

/* struct fi_mr_attr of libfabric 2.x: the 1.17 fields, then hmem_data (1.19), page_size (1.22),
 * base_mr and sub_mr_cnt (2.0). libfabric reads only the fields of the API version the fabric was
 * opened with, so a zeroed tail is correct for every version. */
struct shim_fi_mr_attr {
    union {
        const struct iovec *mr_iov;
        const struct shim_fi_mr_dmabuf *dmabuf;
    };
    size_t iov_count;
    uint64_t access;
    uint64_t offset;
    uint64_t requested_key;
    void *context;
    size_t auth_key_size;
    uint8_t *auth_key;
    enum fi_hmem_iface iface;
    union {
        uint64_t reserved;
        int cuda;
        int ze;
        int neuron;
        int synapseai;
    } device;
    void *hmem_data;
    size_t page_size;
    const struct fid_mr *base_mr;
    size_t sub_mr_cnt;
};

#define SHIM_SAME_FIELD(ours, theirs, field) \
    _Static_assert(offsetof(struct ours, field) == offsetof(struct theirs, field), #field " of " #theirs)
/* The 1.17 prefix always exists in the headers. */
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, iov_count);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, requested_key);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, auth_key);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, iface);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, device);
#ifdef FI_MR_DMABUF
/* Headers of libfabric >= 1.20: the hand-made declarations must match the real ones. */
_Static_assert(FI_MR_DMABUF == SHIM_FI_MR_DMABUF, "FI_MR_DMABUF");
_Static_assert(sizeof(struct shim_fi_mr_dmabuf) == sizeof(struct fi_mr_dmabuf), "size of fi_mr_dmabuf");
SHIM_SAME_FIELD(shim_fi_mr_dmabuf, fi_mr_dmabuf, fd);
SHIM_SAME_FIELD(shim_fi_mr_dmabuf, fi_mr_dmabuf, offset);
SHIM_SAME_FIELD(shim_fi_mr_dmabuf, fi_mr_dmabuf, len);
SHIM_SAME_FIELD(shim_fi_mr_dmabuf, fi_mr_dmabuf, base_addr);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, dmabuf);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, hmem_data);
#endif
#if FI_MAJOR_VERSION >= 2
_Static_assert(sizeof(struct shim_fi_mr_attr) == sizeof(struct fi_mr_attr), "size of fi_mr_attr");
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, page_size);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, base_mr);
SHIM_SAME_FIELD(shim_fi_mr_attr, fi_mr_attr, sub_mr_cnt);
#endif

int shim_fi_mr_regattr2(struct fid_domain *domain, const struct iovec *iov, const struct shim_fi_mr_dmabuf *dmabuf,
                        uint64_t access, uint64_t requested_key, int cuda_device, uint64_t flags,
                        struct fid_mr **mr) {
    struct shim_fi_mr_attr attr;
    memset(&attr, 0, sizeof(attr));
    if (flags & SHIM_FI_MR_DMABUF)
        attr.dmabuf = dmabuf;
    else
        attr.mr_iov = iov;
    attr.iov_count = 1;
    attr.access = access;
    attr.requested_key = requested_key;
    attr.iface = FI_HMEM_SYSTEM;
    if (cuda_device >= 0) {
        attr.iface = FI_HMEM_CUDA;
        attr.device.cuda = cuda_device;
    }
    return fi_mr_regattr(domain, (const struct fi_mr_attr *)&attr, flags, mr);
}
void *shim_fi_mr_desc(struct fid_mr *mr) { return fi_mr_desc(mr); }
uint64_t shim_fi_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }
int shim_fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags) { return fi_mr_bind(mr, bfid, flags); }
int shim_fi_mr_enable(struct fid_mr *mr) { return fi_mr_enable(mr); }
ssize_t shim_fi_writedata(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t data,
                          fi_addr_t dest_addr, uint64_t addr, uint64_t key, void *context) {
    return fi_writedata(ep, buf, len, desc, data, dest_addr, addr, key, context);
}
ssize_t shim_fi_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr,
                      uint64_t addr, uint64_t key, void *context) {
    return fi_write(ep, buf, len, desc, dest_addr, addr, key, context);
}
ssize_t shim_fi_writemsg(struct fid_ep *ep, const struct fi_msg_rma *msg, uint64_t flags) {
    return fi_writemsg(ep, msg, flags);
}
ssize_t shim_fi_read(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, uint64_t addr,
                     uint64_t key, void *context) {
    return fi_read(ep, buf, len, desc, src_addr, addr, key, context);
}
ssize_t shim_fi_send(struct fid_ep *ep, const void *buf, size_t len, void *desc, fi_addr_t dest_addr, void *context) {
    return fi_send(ep, buf, len, desc, dest_addr, context);
}
ssize_t shim_fi_sendmsg(struct fid_ep *ep, const struct fi_msg *msg, uint64_t flags) {
    return fi_sendmsg(ep, msg, flags);
}
ssize_t shim_fi_recv(struct fid_ep *ep, void *buf, size_t len, void *desc, fi_addr_t src_addr, void *context) {
    return fi_recv(ep, buf, len, desc, src_addr, context);
}
ssize_t shim_fi_cq_read(struct fid_cq *cq, void *buf, size_t count) { return fi_cq_read(cq, buf, count); }
ssize_t shim_fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags) {
    return fi_cq_readerr(cq, buf, flags);
}
const char *shim_fi_cq_strerror(struct fid_cq *cq, int prov_errno, const void *err_data, char *buf, size_t len) {
    return fi_cq_strerror(cq, prov_errno, err_data, buf, len);
}
