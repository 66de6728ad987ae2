// coredns: the real node's cluster DNS, CoreDNS with only the plugins its Corefile uses
// (upstream's binary compiles in every plugin, cloud providers included).
package main

import (
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/ready"

	_ "github.com/coredns/coredns/core/dnsserver" // the server type the plugins register with
	"github.com/coredns/coredns/coremain"
)

func main() {
	coremain.Run()
}
