module github.com/forkd/forkd

go 1.26.0

require (
	go.etcd.io/bbolt v1.5.0
	golang.org/x/sys v0.50.0
)

require (
	github.com/google/go-containerregistry v0.22.1 // indirect
	github.com/klauspost/compress v1.19.2 // indirect
	github.com/ulikunitz/xz v0.5.17 // indirect
)
