package serving

import (
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"syscall"
)

// DefaultRouteAddress returns the node's primary address as kubelet picks
// its InternalIP without --node-ip: an address of the interface that holds
// the default route, IPv4 first, then IPv6. Among several default routes
// the lowest metric wins; a route's preferred source address, when it has
// one, is taken over the interface's first global unicast address.
//
// Routes and addresses are read over a NETLINK_ROUTE socket (as ip(8) reads
// them), never from /proc/net: the agent's unit mounts /proc with
// ProcSubset=pid, which hides /proc/net, and allows AF_NETLINK in
// RestrictAddressFamilies for this. Reading routes and addresses over
// netlink needs no capability; changing them needs CAP_NET_ADMIN, which the
// unit does not have.
func DefaultRouteAddress() (net.IP, error) {
	var errs []error
	for _, family := range []int{syscall.AF_INET, syscall.AF_INET6} {
		routes, err := defaultRoutes(family)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, r := range routes {
			ip, err := routeAddress(family, r)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			return ip, nil
		}
	}
	if len(errs) == 0 {
		return nil, errors.New("no default route")
	}
	return nil, errors.Join(errs...)
}

// defaultRoute is one default route of the main table.
type defaultRoute struct {
	ifindex int
	metric  uint32
	prefSrc net.IP
}

// Sizes and offsets of struct rtmsg (linux/rtnetlink.h): family, dst_len,
// src_len, tos, table, protocol, scope, type, then 32 bits of flags.
const (
	rtmsgLen     = 12
	rtmsgDstLen  = 1
	rtmsgTable   = 4
	rtmsgType    = 7
	rtTableMain  = 254 // RT_TABLE_MAIN
	rtnUnicast   = 1   // RTN_UNICAST
	rtaTableAttr = 15  // RTA_TABLE
)

// defaultRoutes dumps the routes of family and returns the default routes
// of the main table through one interface, lowest metric first.
func defaultRoutes(family int) ([]defaultRoute, error) {
	name := map[int]string{syscall.AF_INET: "IPv4", syscall.AF_INET6: "IPv6"}[family]
	rib, err := syscall.NetlinkRIB(syscall.RTM_GETROUTE, family)
	if err != nil {
		return nil, fmt.Errorf("unable to read the %s routes over netlink: %w", name, os.NewSyscallError("netlinkrib", err))
	}
	msgs, err := syscall.ParseNetlinkMessage(rib)
	if err != nil {
		return nil, fmt.Errorf("unable to parse the %s routes: %w", name, err)
	}
	var routes []defaultRoute
	for i := range msgs {
		m := &msgs[i]
		if m.Header.Type != syscall.RTM_NEWROUTE || len(m.Data) < rtmsgLen {
			continue
		}
		if m.Data[rtmsgDstLen] != 0 || m.Data[rtmsgType] != rtnUnicast {
			continue
		}
		attrs, err := syscall.ParseNetlinkRouteAttr(m)
		if err != nil {
			return nil, fmt.Errorf("unable to parse the %s routes: %w", name, err)
		}
		table := uint32(m.Data[rtmsgTable])
		r := defaultRoute{}
		for _, a := range attrs {
			switch a.Attr.Type {
			case rtaTableAttr:
				if len(a.Value) >= 4 {
					table = binary.NativeEndian.Uint32(a.Value)
				}
			case syscall.RTA_OIF:
				if len(a.Value) >= 4 {
					r.ifindex = int(binary.NativeEndian.Uint32(a.Value))
				}
			case syscall.RTA_PRIORITY:
				if len(a.Value) >= 4 {
					r.metric = binary.NativeEndian.Uint32(a.Value)
				}
			case syscall.RTA_PREFSRC:
				r.prefSrc = net.IP(slices.Clone(a.Value))
			}
		}
		// Multipath routes (no RTA_OIF) name no single interface.
		if table == rtTableMain && r.ifindex > 0 {
			routes = append(routes, r)
		}
	}
	slices.SortStableFunc(routes, func(a, b defaultRoute) int { return cmp.Compare(a.metric, b.metric) })
	if len(routes) == 0 {
		return nil, fmt.Errorf("no %s default route", name)
	}
	return routes, nil
}

// routeAddress returns the address of family the route r sends from.
func routeAddress(family int, r defaultRoute) (net.IP, error) {
	iface, err := net.InterfaceByIndex(r.ifindex)
	if err != nil {
		return nil, fmt.Errorf("unable to read interface %d of the default route: %w", r.ifindex, err)
	}
	if iface.Flags&net.FlagUp == 0 {
		return nil, fmt.Errorf("interface %s of the default route is down", iface.Name)
	}
	if r.prefSrc != nil && r.prefSrc.IsGlobalUnicast() {
		return r.prefSrc, nil
	}
	addrs, err := iface.Addrs()
	if err != nil {
		return nil, fmt.Errorf("unable to read the addresses of %s: %w", iface.Name, err)
	}
	for _, a := range addrs {
		n, ok := a.(*net.IPNet)
		if !ok || !n.IP.IsGlobalUnicast() || (n.IP.To4() != nil) != (family == syscall.AF_INET) {
			continue
		}
		return n.IP, nil
	}
	return nil, fmt.Errorf("interface %s of the default route has no global unicast address", iface.Name)
}
