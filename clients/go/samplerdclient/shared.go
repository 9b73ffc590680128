package samplerdclient

import (
	"context"
	"fmt"
	"os"
	"syscall"
	"unsafe"

	pb "github.com/samplerd/samplerd/gen/go/samplerd/v1"
)

// SharedRows is a Rows × Vocab region of f32 logits in a file under
// /dev/shm, mapped here and registered with samplerd, which reads each row
// in place (docs/API.md, "Shared-memory rows"): write Row(i), then name it
// with Ref(i) in SampleRequest.Shared (or a stream's or batch row's). The
// server must run on the same host or in the same pod and be allowed to
// read this user's files (a Unix socket, or the same user over TCP).
// Leave a row alone until its response has arrived.
//
// The rows are the host's float32s as they lie in memory: little-endian on
// every platform grpc-go targets in practice (amd64, arm64).
type SharedRows struct {
	Name  string
	Path  string
	Rows  int
	Vocab int
	mem   []byte
	data  []float32
}

// CreateSharedRows makes /dev/shm/NAME (which must not exist), maps it and
// registers it under NAME.
func CreateSharedRows(ctx context.Context, c pb.SamplerClient, name string, rows, vocab int) (*SharedRows, error) {
	if rows < 1 || vocab < 1 {
		return nil, fmt.Errorf("rows and vocab must be >= 1, got %d and %d", rows, vocab)
	}
	path := "/dev/shm/" + name
	size := rows * vocab * 4
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(int64(size)); err != nil {
		os.Remove(path)
		return nil, err
	}
	mem, err := syscall.Mmap(int(f.Fd()), 0, size, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, err
	}
	s := &SharedRows{
		Name: name, Path: path, Rows: rows, Vocab: vocab, mem: mem,
		data: unsafe.Slice((*float32)(unsafe.Pointer(&mem[0])), rows*vocab),
	}
	_, err = c.RegisterSharedMemory(ctx, &pb.RegisterSharedMemoryRequest{Name: name, Path: path, ByteSize: uint64(size)})
	if err != nil {
		s.release()
		return nil, err
	}
	return s, nil
}

// Row is row i of the region, to write the step's logits into.
func (s *SharedRows) Row(i int) []float32 {
	return s.data[i*s.Vocab : (i+1)*s.Vocab]
}

// Ref names row i for a request's `shared` field.
func (s *SharedRows) Ref(i int) *pb.SharedLogits {
	return &pb.SharedLogits{
		Region: s.Name,
		Offset: uint64(i * s.Vocab * 4),
		Count:  uint32(s.Vocab),
		Dtype:  pb.LogitsDtype_LOGITS_DTYPE_F32LE,
	}
}

func (s *SharedRows) release() {
	syscall.Munmap(s.mem)
	s.mem, s.data = nil, nil
	os.Remove(s.Path)
}

// Close unregisters the region, unmaps it and removes its file.
func (s *SharedRows) Close(ctx context.Context, c pb.SamplerClient) error {
	_, err := c.UnregisterSharedMemory(ctx, &pb.UnregisterSharedMemoryRequest{Name: s.Name})
	s.release()
	return err
}
